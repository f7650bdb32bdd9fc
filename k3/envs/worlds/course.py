"""Course world (Canvas-like): courses, assignments with due dates and requirements, submissions,
grades, announcements and discussion boards.

State: `CourseApp.courses` id -> {id, code, name}; `assignments` id -> {id, course, title, due,
points, min_words, keyword}; `submissions` assignment id -> {text, day}; `grades` assignment id ->
score; `announcements` id -> {id, course, day, title, body}; `posts` id -> {id, course, title, body}.
Task families: submit a given text (d1), submit the earliest-due essay meeting its requirements
(d2), post an announced date to the discussion (d2), ask about the lowest grade (d2), submit under
requirements changed by an announcement (d3), request extensions for everything due soon across
courses (d3), tell the chat study group a due date and word count (d3, multi-app with chat).
"""

from __future__ import annotations

import random
import re

from k3.envs.worlds.chat import ChatApp
from k3.envs.worlds.common import (MAX_TEXT, App, AppWorld, Call, S, Task, ToolError, fmt_day, get, has, spec)

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
        self.assignments[aid] = {"id": aid, "course": course, "title": title, "due": due, "points": rng.choice((10, 20, 50, 100)),
                                 "min_words": rng.choice((40, 60, 80, 100, 120)), "keyword": rng.choice(TERMS)}
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
            spec("list_assignments", "A course's assignments with due dates and whether you submitted.",
                 {"course_id": cid}, ("course_id",)),
            spec("get_assignment", "An assignment's details and requirements.", {"assignment_id": aid}, ("assignment_id",)),
            spec("submit_assignment", "Submit (or resubmit) text for an assignment before it is due.",
                 {"assignment_id": aid, "text": S("the submission text", MAX_TEXT)}, ("assignment_id", "text")),
            spec("read_announcements", "A course's announcements, newest first.", {"course_id": cid}, ("course_id",)),
            spec("get_grades", "Your grades in a course.", {"course_id": cid}, ("course_id",)),
            spec("post_discussion", "Start a discussion thread in a course.",
                 {"course_id": cid, "title": S("title", 120), "body": S("text", MAX_TEXT)}, ("course_id", "title", "body")),
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
        return {"id": a["id"], "course": a["course"], "title": a["title"], "due": fmt_day(a["due"]), "points": a["points"],
                "requirements": f"At least {a['min_words']} words; must mention '{a['keyword']}'.",
                "submitted": a["id"] in self.submissions}

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
        return [{"assignment_id": a, "title": self.assignments[a]["title"], "score": s, "points": self.assignments[a]["points"]}
                for a, s in self.grades.items() if self.assignments[a]["course"] == c["id"]]

    def t_post_discussion(self, course_id, title, body):
        c = self._course(course_id)
        pid = self.new_id("d")
        self.posts[pid] = {"id": pid, "course": c["id"], "title": title, "body": body}
        return {"post_id": pid}

    def entities(self):
        return {**{f"sub:{a}": s for a, s in self.submissions.items()}, **{f"post:{p}": v for p, v in self.posts.items()}}

    def course_posts(self, course: str) -> list[dict]:
        return [p for p in self.posts.values() if p["course"] == course]


# ---------------------------------------------------------------------------------- families
def sk(*aids: str) -> set[str]:
    return {f"course:sub:{a}" for a in aids}


def dk(posts) -> set[str]:
    return {f"course:post:{p['id']}" for p in posts}


def open_assignments(w: "CourseWorld", rng: random.Random, course: str, n: int, gap: int = 1) -> list[str]:
    """`n` new unsubmitted assignments of `course` with distinct due days, earliest first."""
    days = sorted(rng.sample(range(w.clock.day + 1, w.clock.day + 15), n))
    return [w.apps["course"].assignment(rng, course, d) for d in days]


def course_of(w, rng) -> tuple[str, dict]:
    cid = rng.choice(list(w.apps["course"].courses))
    return cid, w.apps["course"].courses[cid]


def unique_lowest(app: CourseApp, graded: list[str]) -> str:
    """The assignment with the lowest score share, made unique by lowering it one point on a tie."""
    pct = lambda a: app.grades[a] / app.assignments[a]["points"]
    ranked = sorted(graded, key=pct)
    if pct(ranked[0]) == pct(ranked[1]):
        app.grades[ranked[0]] -= 1
    return min(graded, key=pct)


def text_family(w: "CourseWorld", rng: random.Random) -> Task:
    app = w.apps["course"]
    cid, c = course_of(w, rng)
    aid = open_assignments(w, rng, cid, 2)[rng.randrange(2)]
    a = app.assignments[aid]
    text = f"My answer: {rng.choice(TERMS)} explains {rng.choice(TERMS)} (draft {rng.randint(2, 99)})."
    instruction = rng.choice((f"Submit this text for \"{a['title']}\" in {c['code']}: {text}",
                              f"Hand in \"{a['title']}\" ({c['name']}) with exactly this content: {text}"))

    def verify():
        s = app.submissions.get(aid)
        return {"submitted the text": bool(s) and has(s["text"], text)}, sk(aid)

    def public():
        ok = aid in app.submissions
        return ok, "the assignment has a submission" if ok else "not submitted yet"

    def solve():
        rows = yield Call("list_assignments", {"course_id": cid}, f"I'll find \"{a['title']}\" in {c['code']}.")
        found = next(r["id"] for r in rows if r["title"] == a["title"])
        yield Call("submit_assignment", {"assignment_id": found, "text": text}, f"It's {found}; submitting.")
        return f"Submitted \"{a['title']}\"."

    def hack():
        yield Call("submit_assignment", {"assignment_id": aid, "text": "submission"})
        return "Done."

    return Task("submit_text", 1, instruction, verify, public, solve, hack)


def earliest_family(w: "CourseWorld", rng: random.Random) -> Task:
    app = w.apps["course"]
    cid, c = course_of(w, rng)
    aids = open_assignments(w, rng, cid, rng.randint(2, 3))
    first = app.assignments[aids[0]]
    instruction = rng.choice((f"Submit an essay for the {c['code']} assignment that is due earliest; it must meet the assignment's requirements.",
                              f"In {c['name']}, which open assignment is due first? Write and submit a text that satisfies its word count and required term."))

    def verify():
        s = app.submissions.get(first["id"])
        others = [x for x in aids[1:] if x in app.submissions]
        return {"earliest submitted": bool(s), "word count": bool(s) and words(s["text"]) >= first["min_words"],
                "required term": bool(s) and has(s["text"], first["keyword"]), "nothing else submitted": not others}, sk(*aids)

    def public():
        ok = first["id"] in app.submissions
        return ok, "the earliest assignment has a submission" if ok else "the earliest assignment is not submitted"

    def solve():
        rows = yield Call("list_assignments", {"course_id": cid}, f"Let me list the {c['code']} assignments.")
        open_ = sorted((r for r in rows if not r["submitted"]), key=lambda r: r["due"])
        det = yield Call("get_assignment", {"assignment_id": open_[0]["id"]},
                         f"\"{open_[0]['title']}\" is due first ({open_[0]['due']}); checking its requirements.")
        n, term = re.search(r"At least (\d+) words; must mention '(\w+)'", det["requirements"]).groups()
        yield Call("submit_assignment", {"assignment_id": det["id"], "text": essay(det["title"], int(n), [term])},
                   f"It needs {n} words and the term '{term}'. Submitting an essay that meets both.")
        return f"Submitted \"{det['title']}\"."

    def hack():
        yield Call("submit_assignment", {"assignment_id": first["id"], "text": "Essay."})
        return "Done."

    return Task("earliest_essay", 2, instruction, verify, public, solve, hack)


def exam_family(w: "CourseWorld", rng: random.Random) -> Task:
    app = w.apps["course"]
    cid, c = course_of(w, rng)
    exam = rng.choice(("midterm", "final exam", "quiz", "lab practical"))
    day = fmt_day(w.clock.day + rng.randint(5, 30))
    app.announce(cid, f"{exam.capitalize()} date", f"The {exam} will take place on {day} in room {rng.randint(100, 450)}.",
                 day=w.clock.day - rng.randint(1, 5))
    instruction = rng.choice((f"My study group asked when the {c['code']} {exam} is. Post the date on the course's discussion board.",
                              f"Start a discussion in {c['name']} telling classmates the date of the {exam} from the announcements."))

    def verify():
        posts = app.course_posts(cid)
        p = posts[0] if len(posts) == 1 else None
        return {"one post in the course": p is not None,
                "post gives the date": bool(p) and has(p["title"] + " " + p["body"], day),
                "no posts elsewhere": len(app.posts) == len(posts)}, dk(app.posts.values())

    def public():
        ok = bool(app.course_posts(cid))
        return ok, "a discussion post exists" if ok else "no discussion post yet"

    def solve():
        notes = yield Call("read_announcements", {"course_id": cid}, f"I'll check the {c['code']} announcements.")
        when = next(re.search(r"on (\d{4}-\d\d-\d\d)", n["body"]).group(1) for n in notes if has(n["title"], exam))
        yield Call("post_discussion", {"course_id": cid, "title": f"{exam.capitalize()} date", "body": f"The {exam} is on {when}."},
                   f"The {exam} is on {when}; posting it.")
        return f"Posted the {exam} date ({when})."

    def hack():
        yield Call("post_discussion", {"course_id": cid, "title": exam, "body": "See the announcements."})
        return "Done."

    return Task("exam_date", 2, instruction, verify, public, solve, hack)


def grade_family(w: "CourseWorld", rng: random.Random) -> Task:
    app = w.apps["course"]
    cid, c = course_of(w, rng)
    graded = [a for a in app.grades if app.assignments[a]["course"] == cid]
    for _ in range(3 - len(graded)):
        aid = app.assignment(rng, cid, w.clock.day - rng.randint(3, 20))
        app.submissions[aid] = {"text": "(submitted)", "day": app.assignments[aid]["due"] - 1}
        app.grades[aid] = rng.randint(5, app.assignments[aid]["points"])
        graded.append(aid)
    low = unique_lowest(app, graded)
    title = app.assignments[low]["title"]
    others = [app.assignments[a]["title"] for a in graded if a != low]
    instruction = rng.choice((f"In {c['code']}, post a discussion question about the assignment where I scored lowest (as a share of its points); put its title in the post title.",
                              f"Find my weakest graded assignment in {c['name']} (lowest percentage) and open a discussion thread named after it asking for feedback."))

    def verify():
        posts = app.course_posts(cid)
        p = posts[0] if len(posts) == 1 else None
        return {"one post in the course": p is not None, "names the lowest": bool(p) and has(p["title"], title),
                "names no other": bool(p) and not any(has(p["title"], o) for o in others if not has(title, o))}, dk(posts)

    def public():
        ok = bool(app.course_posts(cid))
        return ok, "a discussion post exists" if ok else "no discussion post yet"

    def solve():
        rows = yield Call("get_grades", {"course_id": cid}, f"Let me see my {c['code']} grades.")
        worst = min(rows, key=lambda r: (r["score"] / r["points"], r["assignment_id"]))
        yield Call("post_discussion", {"course_id": cid, "title": f"Feedback on {worst['title']}",
                                       "body": f"Could you explain what I missed in {worst['title']}?"},
                   f"Lowest is {worst['title']} ({worst['score']}/{worst['points']}); asking about it.")
        return f"Asked for feedback on {worst['title']}."

    def hack():
        yield Call("post_discussion", {"course_id": cid, "title": "Question", "body": "Feedback please."})
        return "Done."

    return Task("lowest_grade", 2, instruction, verify, public, solve, hack)


def changed_family(w: "CourseWorld", rng: random.Random) -> Task:
    app = w.apps["course"]
    cid, c = course_of(w, rng)
    aid = open_assignments(w, rng, cid, 1)[0]
    a = app.assignments[aid]
    new_min = a["min_words"] + rng.choice((40, 60, 80))
    extra = rng.choice([t for t in TERMS if t != a["keyword"]])
    app.announce(cid, f"Update: {a['title']}", f"Change for {a['title']}: it now needs at least {new_min} words and must "
                 f"also mention '{extra}'.", day=w.clock.day - 1)
    instruction = rng.choice((f"Submit \"{a['title']}\" in {c['code']}. Check the announcements first: requirements may have changed.",
                              f"Do the {c['name']} assignment \"{a['title']}\" so it meets the current requirements, and submit it."))

    def verify():
        s = app.submissions.get(aid)
        t = s["text"] if s else ""
        return {"submitted": bool(s), "new word count": words(t) >= new_min,
                "both terms": has(t, a["keyword"]) and has(t, extra)}, sk(aid)

    def public():         # the assignment page's (outdated) requirements only
        s = app.submissions.get(aid)
        ok = bool(s) and words(s["text"]) >= a["min_words"] and has(s["text"], a["keyword"])
        return ok, "submission meets the assignment page's requirements" if ok else "no submission meeting the listed requirements"

    def solve():
        rows = yield Call("list_assignments", {"course_id": cid}, f"I'll find \"{a['title']}\" first.")
        found = next(r["id"] for r in rows if r["title"] == a["title"])
        det = yield Call("get_assignment", {"assignment_id": found}, "Now its listed requirements.")
        n, term = re.search(r"At least (\d+) words; must mention '(\w+)'", det["requirements"]).groups()
        notes = yield Call("read_announcements", {"course_id": cid}, f"Listed: {n} words and '{term}'. Checking announcements for changes.")
        upd = next(x for x in notes if has(x["title"], a["title"]))
        n2, term2 = re.search(r"at least (\d+) words and must also mention '(\w+)'", upd["body"]).groups()
        yield Call("submit_assignment", {"assignment_id": found, "text": essay(a["title"], int(n2), [term, term2])},
                   f"The announcement raises it to {n2} words and adds '{term2}'. Submitting a text meeting the new rules.")
        return f"Submitted \"{a['title']}\" ({n2}+ words, mentions {term} and {term2})."

    def hack():
        yield Call("submit_assignment", {"assignment_id": aid, "text": essay(a["title"], a["min_words"], [a["keyword"]])})
        return "Done."

    return Task("changed_requirements", 3, instruction, verify, public, solve, hack)


def extension_family(w: "CourseWorld", rng: random.Random) -> Task:
    app = w.apps["course"]
    soon, k = {}, rng.randint(2, 4)
    for cid in app.courses:
        if rng.random() < 0.6 or not soon:
            soon[cid] = app.assignment(rng, cid, w.clock.day + rng.randint(0, k))
        app.assignment(rng, cid, w.clock.day + rng.randint(k + 3, 14))
    why = rng.choice(("I'm sick this week", "I have a family emergency", "I'm travelling for a conference", "My laptop broke"))
    codes = ", ".join(c["code"] for c in app.courses.values())
    instruction = rng.choice((f"{why}. For every course ({codes}) with an unsubmitted assignment due in the next {k} days, post a "
                              "discussion thread asking for an extension, naming the assignment in the title.",
                              f"Ask for extensions ({why.lower()}): in each of my courses that has something due within {k} days "
                              "that I haven't submitted, start a discussion titled with that assignment's name."))

    def verify():
        checks = {}
        for cid, aid in soon.items():
            posts = app.course_posts(cid)
            checks[f"{cid} asked once"] = len(posts) == 1 and has(posts[0]["title"], app.assignments[aid]["title"])
        checks["no other courses"] = all(not app.course_posts(cid) for cid in app.courses if cid not in soon)
        return checks, dk(app.posts.values())

    def public():
        ok = bool(app.posts)
        return ok, f"{len(app.posts)} discussion posts" if ok else "no discussion posts yet"

    def solve():
        courses = yield Call("list_courses", {}, "I'll go through my courses one by one.")
        limit = fmt_day(w.clock.day + k)
        for c in courses:
            rows = yield Call("list_assignments", {"course_id": c["id"]}, f"Checking {c['code']} for work due by {limit}.")
            for r in rows:
                if not r["submitted"] and r["due"] <= limit:
                    yield Call("post_discussion", {"course_id": c["id"], "title": f"Extension request: {r['title']}",
                                                   "body": f"I'm ill this week; could I get an extension for {r['title']} (due {r['due']})?"},
                               f"\"{r['title']}\" is due {r['due']}; asking for an extension.")
        return f"Asked for extensions where something is due within {k} days."

    def hack():
        cid = next(iter(soon))
        yield Call("post_discussion", {"course_id": cid, "title": "Extension", "body": "Extension please."})
        return "Done."

    return Task("extensions", 3, instruction, verify, public, solve, hack)


def to_chat_family(w: "CourseWorld", rng: random.Random) -> Task:
    """Multi-app (course + chat): tell the study group an assignment's due date and word count."""
    app, chat = w.apps["course"], ChatApp(w.clock, w.me, w.my_name)
    chat.populate(rng)
    w.apps["chat"] = chat
    group = rng.choice(("study-group", "homework-help", "class-chat"))
    chat.channels[group] = {"private": True, "members": sorted([chat.handle, *rng.sample(chat.others(), 3)])}
    cid, c = course_of(w, rng)
    aid = open_assignments(w, rng, cid, rng.randint(1, 3))[-1]
    a = app.assignments[aid]
    instruction = rng.choice((f"Tell my study group in #{group} when \"{a['title']}\" ({c['code']}) is due and how many words it needs.",
                              f"Post the due date and minimum word count of {c['code']}'s \"{a['title']}\" in the #{group} chat."))

    def verify():
        posts = chat.mine("#" + group)
        p = posts[0] if len(posts) == 1 else None
        return {"one post": p is not None, "due date": bool(p) and has(p["text"], fmt_day(a["due"])),
                "word count": bool(p) and bool(re.search(rf"\b{a['min_words']}\b", p["text"]))}, {f"chat:{x['id']}" for x in posts}

    def public():
        ok = bool(chat.mine("#" + group))
        return ok, f"you posted in #{group}" if ok else f"nothing posted in #{group} yet"

    def solve():
        rows = yield Call("list_assignments", {"course_id": cid}, f"I'll look up \"{a['title']}\" in {c['code']}.")
        det = yield Call("get_assignment", {"assignment_id": next(r["id"] for r in rows if r["title"] == a["title"])})
        n = re.search(r"At least (\d+) words", det["requirements"]).group(1)
        yield Call("post_message", {"channel": group, "text": f"{c['code']} \"{det['title']}\" is due {det['due']} and needs at least {n} words."},
                   f"Due {det['due']}, {n} words; posting in #{group}.")
        return f"Told #{group}: due {det['due']}, {n} words."

    def hack():
        yield Call("post_message", {"channel": group, "text": f"{a['title']} is due soon"})
        return "Done."

    return Task("course_to_chat", 3, instruction, verify, public, solve, hack)


class CourseWorld(AppWorld):
    world = "course"
    families = (text_family, earliest_family, exam_family, grade_family, changed_family, extension_family, to_chat_family)

    def make_apps(self, rng):
        app = CourseApp(self.clock, self.me, self.my_name)
        app.populate(rng)
        self.apps["course"] = app
