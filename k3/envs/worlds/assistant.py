"""Assistant world: multi-app, multi-day jobs whose events depend on each other.

Each task combines two or three of the mail / chat / notes / course apps (a core subset of their
tools, to keep the tool list short) and a simulated calendar: `advance_day` ends the day and
delivers the next day's events (new mail, chat messages, announcements). Verifiers read the final
state, which must reflect the latest information. Families: share a value from mail in chat (d2),
submit with an extra requirement sent by mail (d2), record a mailed request and apply tomorrow's
chat update (d3), announce a meeting and apply a next-day correction in chat and notes (d3), send
a reminder on the day asked for (d3), submit after the professor's next-day update (d3).
"""

from __future__ import annotations

import random
import re

from k3.envs.worlds.chat import ChatApp
from k3.envs.worlds.common import FIRST, TOPICS, AppWorld, Call, Task, fmt_day, has, person
from k3.envs.worlds.course import CourseApp, essay, words
from k3.envs.worlds.mail import MailApp, find_id
from k3.envs.worlds.notes import OBJECTS, VERBS, NotesApp

CORE = frozenset({
    "search_emails", "read_email", "send_email", "reply_email",
    "list_channels", "read_channel", "post_message", "send_dm", "read_dms",
    "search_pages", "read_page", "append_block", "query_database", "add_row", "update_row",
    "list_courses", "list_assignments", "get_assignment", "submit_assignment", "read_announcements",
})


def use(w: "AssistantWorld", rng: random.Random, *names: str) -> list:
    """Create and populate the named apps (in this order, so generation is seed-deterministic)."""
    out = []
    for name in names:
        app = {"mail": MailApp, "chat": ChatApp, "notes": NotesApp, "course": CourseApp}[name](w.clock, w.me, w.my_name)
        app.populate(rng, w.taken) if name == "mail" else app.populate(rng)
        w.apps[name] = app
        out.append(app)
    return out


def time_of(rng: random.Random) -> str:
    return f"{rng.randint(9, 16)}:{rng.choice(('00', '30'))}"


def share_family(w: "AssistantWorld", rng: random.Random) -> Task:
    mail, chat = use(w, rng, "mail", "chat")
    xn, xa = person(rng, w.taken)
    ch = rng.choice(list(chat.channels))
    topic = rng.choice(TOPICS)
    thing, code = rng.choice((("dial-in number", f"+1-555-{rng.randint(1000, 9999)}"), ("venue", f"Hall {rng.choice('ABCDEFG')}{rng.randint(1, 9)}"),
                              ("budget code", f"BC-{rng.randint(100, 999)}")))
    mail.deliver(xa, xn, f"{topic.capitalize()}: {thing}", f"Hi,\n\nThe {thing} for the {topic} is {code}.\n\n{xn}", w.clock.day - 1)
    xf = xn.split()[0]
    instruction = rng.choice((f"{xf} emailed me the {thing} for the {topic}. Share it with the team in #{ch}.",
                              f"Post the {topic} {thing} (it's in my mail from {xn}) to the #{ch} channel."))

    def verify():
        mine = chat.mine("#" + ch)
        m = mine[0] if len(mine) == 1 else None
        return {"one post": m is not None, "has the value": bool(m) and has(m["text"], code)}, {f"chat:{x['id']}" for x in mine}

    def public():
        ok = bool(chat.mine("#" + ch))
        return ok, f"you posted in #{ch}" if ok else f"nothing posted in #{ch}"

    def solve():
        res = yield Call("search_emails", {"sender": xf, "query": thing}, f"I'll find {xf}'s email with the {thing}.")
        msg = yield Call("read_email", {"email_id": find_id(res, subject=thing)})
        value = re.search(rf"The {re.escape(thing)} for the [\w ]+ is (.+?)\.\n", msg["body"]).group(1)
        yield Call("post_message", {"channel": ch, "text": f"The {thing} for the {topic} is {value}."}, f"It's {value}; posting in #{ch}.")
        return f"Shared the {thing} in #{ch}."

    def hack():
        yield Call("post_message", {"channel": ch, "text": f"{thing} is in my mail"})
        return "Done."

    return Task("mail_to_chat", 2, instruction, verify, public, solve, hack)


def prof_family(w: "AssistantWorld", rng: random.Random) -> Task:
    mail, course = use(w, rng, "mail", "course")
    cid = rng.choice(list(course.courses))
    aid = course.assignment(rng, cid, w.clock.day + rng.randint(1, 5))
    a = course.assignments[aid]
    pn, pa = person(rng, w.taken)
    extra = rng.choice([t for t in ("evidence", "feedback", "momentum", "memory", "hypothesis") if t != a["keyword"]])
    mail.deliver(pa, "Prof. " + pn, f"{cid.upper()}: note on {a['title']}",
                 f"Dear students,\n\nIn {a['title']} please also mention '{extra}'.\n\n{pn}", w.clock.day)
    instruction = rng.choice((f"Submit \"{a['title']}\" for {cid.upper()}; my professor emailed an extra requirement.",
                              f"Do the {cid.upper()} assignment \"{a['title']}\", following both the course page and the professor's email."))

    def verify():
        s = course.submissions.get(aid)
        t = s["text"] if s else ""
        return {"submitted": bool(s), "word count": words(t) >= a["min_words"],
                "course and email terms": has(t, a["keyword"]) and has(t, extra)}, {f"course:sub:{aid}"}

    def public():
        s = course.submissions.get(aid)
        ok = bool(s) and words(s["text"]) >= a["min_words"] and has(s["text"], a["keyword"])
        return ok, "meets the course page's requirements" if ok else "no submission meeting the course page's requirements"

    def solve():
        rows = yield Call("list_assignments", {"course_id": cid}, f"First the assignment in {cid.upper()}.")
        found = next(r["id"] for r in rows if r["title"] == a["title"])
        det = yield Call("get_assignment", {"assignment_id": found})
        n, term = re.search(r"At least (\d+) words; must mention '(\w+)'", det["requirements"]).groups()
        res = yield Call("search_emails", {"query": a["title"]}, f"Page: {n} words and '{term}'. Now the professor's email.")
        msg = yield Call("read_email", {"email_id": find_id(res, subject=a["title"])})
        term2 = re.search(r"also mention '(\w+)'", msg["body"]).group(1)
        yield Call("submit_assignment", {"assignment_id": found, "text": essay(a["title"], int(n), [term, term2])},
                   f"The email adds '{term2}'. Submitting a text with both terms.")
        return f"Submitted \"{a['title']}\"."

    def hack():
        yield Call("submit_assignment", {"assignment_id": aid, "text": essay(a["title"], a["min_words"], [a["keyword"]])})
        return "Done."

    return Task("prof_requirement", 2, instruction, verify, public, solve, hack)


def deadline_family(w: "AssistantWorld", rng: random.Random) -> Task:
    mail, chat, notes = use(w, rng, "mail", "chat", "notes")
    bn, ba = person(rng, w.taken)
    bf = bn.split()[0]
    ch = rng.choice(list(chat.channels))
    chat.users.setdefault(bf.lower(), bn)
    existing = notes.task_names()
    project = next(p for p in (f"{rng.choice(VERBS).capitalize()} {rng.choice(OBJECTS)}" for _ in range(99)) if p not in existing)
    owner = rng.choice(FIRST)
    d1, d2 = fmt_day(w.clock.day + rng.randint(3, 6)), fmt_day(w.clock.day + rng.randint(8, 14))
    mail.deliver(ba, bn, f"New task: {project}", f"Hi,\n\nPlease add \"{project}\" to the Tasks database, owner {owner}, due {d1}.\n\n{bf}")
    w.clock.at(w.clock.day + 1, lambda: chat.post("#" + ch, bf.lower(), f"Update: the deadline for \"{project}\" moved to {d2}."))
    instruction = rng.choice((f"For the next two days, handle my requests: tasks that arrive by mail go into the notes Tasks database "
                              f"(status Todo), and keep them up to date with news in #{ch}. Finish on the second day.",
                              f"Track {bf}'s requests over today and tomorrow: record them in the Tasks database (Todo) and apply any "
                              f"changes announced in #{ch}."))

    def verify():
        rows = {r: c for r, c in notes.dbs["tasks"]["rows"].items() if has(c["Name"], project)}
        c = next(iter(rows.values())) if len(rows) == 1 else None
        return {"one row": c is not None, "owner and status": bool(c) and c["Owner"] == owner and c["Status"] == "Todo",
                "latest deadline": bool(c) and c["Due"] == d2, "waited for the update": w.clock.day == 11}, {f"notes:row:tasks:{r}" for r in rows}

    def public():
        ok = any(has(c["Name"], project) for c in notes.dbs["tasks"]["rows"].values())
        return ok, "the task is in the database" if ok else "the mailed task is not recorded"

    def solve():
        res = yield Call("search_emails", {"query": "New task"}, "Let me check my mail for requests.")
        msg = yield Call("read_email", {"email_id": find_id(res, subject="New task")})
        name, who, due = re.search(r'add "(.+)" to the Tasks database, owner (\w+), due (\S+)\.', msg["body"]).groups()
        row = yield Call("add_row", {"database_id": "tasks", "cells": {"Name": name, "Owner": who, "Status": "Todo", "Due": due}},
                         f"{bf} asks for \"{name}\" (owner {who}, due {due}); adding it.")
        yield Call("advance_day", {}, "Recorded. Moving to the next day.")
        posts = yield Call("read_channel", {"channel": ch}, f"Checking #{ch} for updates.")
        new_due = next(re.search(r"moved to (\S+)\.", p["text"]).group(1) for p in posts if has(p["text"], name))
        yield Call("update_row", {"database_id": "tasks", "row_id": row["row_id"], "column": "Due", "value": new_due},
                   f"The deadline moved to {new_due}; updating the row.")
        return f"\"{name}\" is recorded with the new deadline {new_due}."

    def hack():
        yield Call("add_row", {"database_id": "tasks", "cells": {"Name": project, "Owner": owner, "Status": "Todo", "Due": d1}})
        return "Done."

    return Task("deadline_update", 3, instruction, verify, public, solve, hack, days=2)


def meeting_family(w: "AssistantWorld", rng: random.Random) -> Task:
    mail, chat, notes = use(w, rng, "mail", "chat", "notes")
    xn, xa = person(rng, w.taken)
    xf = xn.split()[0]
    ch = rng.choice(list(chat.channels))
    topic, weekday = rng.choice(TOPICS), rng.choice(("Monday", "Tuesday", "Wednesday", "Thursday", "Friday"))
    t1, t2 = rng.sample([f"{h}:{m}" for h in range(9, 17) for m in ("00", "30")], 2)
    log = notes.page("Meeting log", None, ("meeting",), ["Upcoming meetings:"])
    mail.deliver(xa, xn, f"{topic.capitalize()} meeting", f"Hi,\n\nPlease announce in #{ch} that the {topic} meeting is on {weekday} at {t1}.\n\n{xf}")
    w.clock.at(w.clock.day + 1, lambda: mail.deliver(
        xa, xn, f"Correction: {topic} meeting", f"Hi,\n\nCorrection: the {topic} meeting is at {t2} instead. Please tell #{ch} "
        f"and add the meeting to the Meeting log page.\n\n{xf}"))
    instruction = rng.choice((f"Handle {xn}'s email requests today and tomorrow; the final state must reflect the latest information.",
                              f"You run my errands for two days: do what {xf} asks by mail, and keep everything up to date."))
    n0 = len(notes.pages[log]["blocks"])

    def verify():
        posts = chat.mine("#" + ch)
        blocks = notes.pages[log]["blocks"][n0:]
        return {"channel told the latest time": bool(posts) and has(posts[-1]["text"], t2),
                "log has the latest time": any(has(b, t2) and has(b, topic) for b in blocks),
                "log has no stale time": not any(has(b, t1) for b in blocks),
                "waited for the correction": w.clock.day == 11}, {f"chat:{p['id']}" for p in posts} | {f"notes:page:{log}"}

    def public():
        ok = bool(chat.mine("#" + ch))
        return ok, f"you posted in #{ch}" if ok else f"nothing posted in #{ch} yet"

    def solve():
        res = yield Call("search_emails", {"sender": xf}, f"Let me see what {xf} asked for.")
        msg = yield Call("read_email", {"email_id": find_id(res, subject="meeting")})
        when = re.search(r"is on (\w+ at \S+)\.", msg["body"]).group(1)
        yield Call("post_message", {"channel": ch, "text": f"The {topic} meeting is on {when}."}, f"Announcing the meeting ({when}) in #{ch}.")
        yield Call("advance_day", {}, "Done for today; next day.")
        res = yield Call("search_emails", {"sender": xf, "query": "Correction"}, f"Any news from {xf}?")
        msg = yield Call("read_email", {"email_id": find_id(res, subject="Correction")})
        new = re.search(r"is at (\S+) instead", msg["body"]).group(1)
        yield Call("post_message", {"channel": ch, "text": f"Correction: the {topic} meeting is on {weekday} at {new}."},
                   f"The meeting moved to {new}; correcting it in #{ch}.")
        pages = yield Call("search_pages", {"query": "Meeting log"}, "Now the Meeting log page.")
        pid = next(p["id"] for p in pages if p["title"] == "Meeting log")
        yield Call("append_block", {"page_id": pid, "text": f"{topic.capitalize()} meeting: {weekday} at {new}"})
        return f"Announced the {topic} meeting, corrected it to {new} and logged it."

    def hack():
        yield Call("post_message", {"channel": ch, "text": f"The {topic} meeting is on {weekday} at {t1}."})
        return "Done."

    return Task("meeting_correction", 3, instruction, verify, public, solve, hack, days=2)


def reminder_family(w: "AssistantWorld", rng: random.Random) -> Task:
    chat, mail = use(w, rng, "chat", "mail")
    x = rng.choice(chat.others())
    xn = chat.users[x]
    xa = f"{x}.{xn.split()[-1].lower()}@{rng.choice(('acme.com', 'globex.io', 'stark.dev'))}"
    thing = rng.choice(("dentist appointment", "report deadline", "rent payment", "visa renewal", "team lunch"))
    when = fmt_day(w.clock.day + 2)
    chat.post("@" + x, x, f"Could you email me a reminder about the {thing} on {when}? My address is {xa}. Thanks!")
    instruction = rng.choice((f"Check my direct messages from {xn} and take care of the request. This job runs for 3 days.",
                              f"{xn} sent me a DM with a request; handle it over the coming days (3 days in total).",
                              f"For the next three days, look after whatever {xn.split()[0]} ({x}) asked me in chat."))

    def verify():
        sent = mail.sent()
        m = sent[0] if len(sent) == 1 else None
        return {"one email": m is not None, "to the requester": bool(m) and m["to"] == [xa],
                "mentions the subject": bool(m) and has(m["body"] + m["subject"], thing),
                "sent on the day asked": bool(m) and fmt_day(m["day"]) == when}, {f"mail:{s['id']}" for s in sent}

    def public():
        ok = any(xa in m["to"] for m in mail.sent())
        return ok, "an email to them was sent" if ok else "nothing sent to them yet"

    def solve():
        dms = yield Call("read_dms", {"user": x}, f"Let me read {xn.split()[0]}'s message.")
        text = dms[-1]["text"]
        what, day, addr = re.search(r"about the (.+) on (\S+)\? My address is (\S+)\. ", text).groups()
        for _ in range(2):
            now = yield Call("advance_day", {}, f"The reminder is for {day}; I wait until then.")
        yield Call("send_email", {"to": [addr], "subject": f"Reminder: {what}", "body": f"Hi, a reminder about the {what} today ({now['today']})."},
                   f"It's {now['today']}: sending the reminder.")
        return f"Sent the {what} reminder on {day}."

    def hack():
        yield Call("send_email", {"to": [xa], "subject": f"Reminder: {thing}", "body": f"Reminder: {thing}."})
        return "Done."

    return Task("reminder", 3, instruction, verify, public, solve, hack, days=3)


def update_family(w: "AssistantWorld", rng: random.Random) -> Task:
    course, mail = use(w, rng, "course", "mail")
    cid = rng.choice(list(course.courses))
    aid = course.assignment(rng, cid, w.clock.day + 2)
    a = course.assignments[aid]
    new_min = a["min_words"] + rng.choice((30, 50, 70))
    pn, pa = person(rng, w.taken)
    w.clock.at(w.clock.day + 1, lambda: mail.deliver(pa, "Prof. " + pn, f"Update for {a['title']}",
                                                     f"Dear students,\n\n{a['title']} now needs at least {new_min} words.\n\n{pn}"))
    instruction = rng.choice((f"Over the next 3 days make sure \"{a['title']}\" ({cid.upper()}) is submitted by its due date and meets "
                              f"the latest requirements; my professor sometimes emails updates.",
                              f"Get \"{a['title']}\" for {cid.upper()} done before it is due, following any update from the professor."))

    def verify():
        s = course.submissions.get(aid)
        t = s["text"] if s else ""
        return {"submitted": bool(s), "updated word count": words(t) >= new_min, "required term": has(t, a["keyword"])}, {f"course:sub:{aid}"}

    def public():
        s = course.submissions.get(aid)
        ok = bool(s) and words(s["text"]) >= a["min_words"] and has(s["text"], a["keyword"])
        return ok, "meets the course page's requirements" if ok else "no submission meeting the course page's requirements"

    def solve():
        rows = yield Call("list_assignments", {"course_id": cid}, f"Let me find \"{a['title']}\".")
        r = next(r for r in rows if r["title"] == a["title"])
        det = yield Call("get_assignment", {"assignment_id": r["id"]})
        n, term = re.search(r"At least (\d+) words; must mention '(\w+)'", det["requirements"]).groups()
        yield Call("advance_day", {}, f"Due {r['due']}, needs {n} words and '{term}'. I'll wait a day for updates before submitting.")
        res = yield Call("search_emails", {"query": a["title"]}, "Any update from the professor?")
        if res["results"]:
            msg = yield Call("read_email", {"email_id": res["results"][0]["id"]})
            n = re.search(r"at least (\d+) words", msg["body"]).group(1)
        yield Call("submit_assignment", {"assignment_id": r["id"], "text": essay(a["title"], int(n), [term])},
                   f"The requirement is now {n} words; submitting.")
        return f"Submitted \"{a['title']}\" with at least {n} words."

    def hack():
        yield Call("submit_assignment", {"assignment_id": aid, "text": essay(a["title"], a["min_words"], [a["keyword"]])})
        return "Done."

    return Task("late_update", 3, instruction, verify, public, solve, hack, days=3)


class AssistantWorld(AppWorld):
    world = "assistant"
    families = (share_family, prof_family, deadline_family, meeting_family, reminder_family, update_family)
    allow = CORE | {"read_thread", "search_messages"}

    def make_apps(self, rng):
        self.taken: set[str] = set()       # each family builds the apps it needs
