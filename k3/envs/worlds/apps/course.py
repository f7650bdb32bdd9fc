"""The course app (Canvas-like): courses, assignments with due dates and requirements,
submissions, grades, announcements and discussion boards.

State: `CourseApp.courses` id -> {id, code, name}; `assignments` id -> {id, course, title, due,
points, min_words, keyword}; `submissions` assignment id -> {text, day}; `grades` assignment id ->
score; `announcements` id -> {id, course, day, title, body}; `posts` id -> {id, course, title, body}.
"""

from __future__ import annotations

import random
import re

from k3.envs.worlds.common import MAX_TEXT, App, S, ToolError, fmt_day, get, spec

SUBJECTS = (("BIO", "Cell Biology"), ("HIS", "Modern History"), ("CS", "Data Structures"), ("ECO", "Microeconomics"),
            ("PHY", "Mechanics"), ("LIT", "World Literature"), ("MAT", "Linear Algebra"), ("PSY", "Cognition"))
KINDS = ("Essay", "Reflection", "Lab report", "Case study", "Reading response", "Project proposal")
TERMS = ("entropy", "mitosis", "inflation", "recursion", "empire", "momentum", "metaphor", "eigenvalue",
         "memory", "feedback", "evidence", "hypothesis")
FILLER = ("the", "argument", "shows", "that", "this", "idea", "matters", "because", "it", "explains", "how",
          "results", "change", "over", "time", "in", "practice")


def words(text: str) -> int:
    return len(re.findall(r"\b\w+\b", text))


def essay(title: str, n_words: int, terms: list[str]) -> str:
    """A deterministic text of at least `n_words` words that mentions every term (oracle helper)."""
    head = f"{title}. This text discusses {' and '.join(terms)}."
    body = [FILLER[i % len(FILLER)] for i in range(max(0, n_words - words(head)) + 3)]
    return head + " " + " ".join(body).capitalize() + "."


class CourseApp(App):
    name = "course"

    def __init__(self, clock, me, my_name):
        super().__init__(clock, me, my_name)
        self.courses: dict[str, dict] = {}
        self.assignments: dict[str, dict] = {}
        self.submissions: dict[str, dict] = {}
        self.grades: dict[str, int] = {}
        self.announcements: dict[str, dict] = {}
        self.posts: dict[str, dict] = {}

    # ------------------------------------------------------------------ content
    def assignment(self, rng: random.Random, course: str, due: int, title: str | None = None) -> str:
        aid = self.new_id("a")
        taken = {a["title"] for a in self.assignments.values() if a["course"] == course}
        while title is None or title in taken:
            title = f"{rng.choice(KINDS)} {rng.randint(1, 12)}"
        self.assignments[aid] = {
            "id": aid,
            "course": course,
            "title": title,
            "due": due,
            "points": rng.choice((10, 20, 50, 100)),
            "min_words": rng.choice((40, 60, 80, 100, 120)),
            "keyword": rng.choice(TERMS),
        }
        return aid

    def announce(self, course: str, title: str, body: str, day: int | None = None) -> str:
        nid = self.new_id("n")
        self.announcements[nid] = {"id": nid, "course": course, "day": self.clock.day if day is None else day,
                                   "title": title, "body": body}
        return nid

    def populate(self, rng: random.Random) -> None:
        for code, name in rng.sample(SUBJECTS, rng.randint(2, 4)):
            cid = code.lower() + str(rng.randint(100, 399))
            self.courses[cid] = {"id": cid, "code": cid.upper(), "name": name}
            for _ in range(rng.randint(1, 3)):           # graded past work
                aid = self.assignment(rng, cid, self.clock.day - rng.randint(3, 20))
                self.submissions[aid] = {"text": "(submitted)", "day": self.assignments[aid]["due"] - 1}
                self.grades[aid] = rng.randint(5, self.assignments[aid]["points"])
            self.announce(cid, "Welcome", f"Welcome to {name}!", day=0)

    # ------------------------------------------------------------------ tools
    def specs(self):
        cid, aid = S("course id, e.g. bio210"), S("assignment id, e.g. a4")
        return [
            spec("list_courses", "Your courses."),
            spec(
                "list_assignments",
                "A course's assignments with due dates and whether you submitted.",
                {"course_id": cid},
                ("course_id",),
            ),
            spec(
                "get_assignment",
                "An assignment's details and requirements.",
                {"assignment_id": aid},
                ("assignment_id",),
            ),
            spec(
                "submit_assignment",
                "Submit (or resubmit) text for an assignment before it is due.",
                {"assignment_id": aid, "text": S("the submission text", MAX_TEXT)},
                ("assignment_id", "text"),
            ),
            spec("read_announcements", "A course's announcements, newest first.", {"course_id": cid}, ("course_id",)),
            spec("get_grades", "Your grades in a course.", {"course_id": cid}, ("course_id",)),
            spec(
                "post_discussion",
                "Start a discussion thread in a course.",
                {"course_id": cid, "title": S("title", 120), "body": S("text", MAX_TEXT)},
                ("course_id", "title", "body"),
            ),
        ]

    def _course(self, course_id):
        return get(self.courses, course_id.lower(), "course", "Use list_courses to see course ids.")

    def _assignment(self, assignment_id):
        return get(self.assignments, assignment_id, "assignment", "Use list_assignments to find assignment ids.")

    def t_list_courses(self):
        return list(self.courses.values())

    def t_list_assignments(self, course_id):
        c = self._course(course_id)
        return [{"id": a["id"], "title": a["title"], "due": fmt_day(a["due"]), "submitted": a["id"] in self.submissions}
                for a in self.assignments.values() if a["course"] == c["id"]]

    def t_get_assignment(self, assignment_id):
        a = self._assignment(assignment_id)
        return {
            "id": a["id"],
            "course": a["course"],
            "title": a["title"],
            "due": fmt_day(a["due"]),
            "points": a["points"],
            "requirements": f"At least {a['min_words']} words; must mention '{a['keyword']}'.",
            "submitted": a["id"] in self.submissions,
        }

    def t_submit_assignment(self, assignment_id, text):
        a = self._assignment(assignment_id)
        if a["due"] < self.clock.day:
            raise ToolError(f"{a['title']} was due {fmt_day(a['due'])}; submissions are closed")
        if not text.strip():
            raise ToolError("text is empty")
        self.submissions[assignment_id] = {"text": text, "day": self.clock.day}
        return {"assignment_id": assignment_id, "status": "submitted", "words": words(text)}

    def t_read_announcements(self, course_id):
        c = self._course(course_id)
        rows = [n for n in self.announcements.values() if n["course"] == c["id"] and n["day"] <= self.clock.day]
        return [{"title": n["title"], "date": fmt_day(n["day"]), "body": n["body"]}
                for n in sorted(rows, key=lambda n: -n["day"])]

    def t_get_grades(self, course_id):
        c = self._course(course_id)
        return [
            {
                "assignment_id": a,
                "title": self.assignments[a]["title"],
                "score": s,
                "points": self.assignments[a]["points"],
            }
            for a, s in self.grades.items()
            if self.assignments[a]["course"] == c["id"]
        ]

    def t_post_discussion(self, course_id, title, body):
        c = self._course(course_id)
        pid = self.new_id("d")
        self.posts[pid] = {"id": pid, "course": c["id"], "title": title, "body": body}
        return {"post_id": pid}

    def entities(self):
        return {
            **{f"sub:{a}": s for a, s in self.submissions.items()},
            **{f"post:{p}": v for p, v in self.posts.items()},
        }

    def course_posts(self, course: str) -> list[dict]:
        return [p for p in self.posts.values() if p["course"] == course]
