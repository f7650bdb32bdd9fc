"""Mail world (Gmail-like): an inbox of generated messages and tasks over it.

State: `MailApp.msgs` id -> {id, from, from_name, to, cc, subject, body, labels, day, folder,
reply_to, forward_of}; folders inbox / archive / sent / drafts / trash. Task families: reply with a
fact (d1), archive newsletters (d1), send with cc (d2), forward last week's invoices (d2), label a
domain's mail (d2), relay a fact from one thread into another (d3), turn an email's action items
into rows of the notes app's Tasks database (d3, multi-app).
"""

from __future__ import annotations

import random
import re

from k3.envs.worlds.common import (FIRST, MAX_LIST, MAX_TEXT, ORGS, TOPICS, A, App, AppWorld, B, Call, S, Task,
                                   ToolError, fmt_day, get, has, make_fact, person, spec)
from k3.envs.worlds.notes import OBJECTS, VERBS, NotesApp

FOLDERS = ("inbox", "archive", "sent", "drafts", "trash")
EMAIL_RE = re.compile(r"^[\w.+-]+@[\w-]+(\.[\w-]+)+$")
FILLER = ("Let me know what you think.", "Thanks in advance.", "Happy to discuss on a call.",
          "See the notes from last time.", "No rush on this one.", "Ping me with questions.")
BRANDS = ("TechDigest", "Daily Brief", "Product Hunt", "DevWeekly", "Market Watch", "Design Notes")
VENDORS = ("cloudhost", "officeparts", "printshop", "catering-co", "travelwise")


class MailApp(App):
    name = "mail"

    def __init__(self, clock, me, my_name):
        super().__init__(clock, me, my_name)
        self.msgs: dict[str, dict] = {}

    # ------------------------------------------------------------------ content
    def deliver(self, sender: str, name: str, subject: str, body: str, day: int | None = None,
                labels: tuple[str, ...] = (), folder: str = "inbox") -> str:
        mid = self.new_id("m")
        self.msgs[mid] = {"id": mid, "from": sender, "from_name": name, "to": [self.me], "cc": [],
                          "subject": subject, "body": body, "labels": list(labels),
                          "day": self.clock.day if day is None else day, "folder": folder,
                          "reply_to": None, "forward_of": None}
        return mid

    def populate(self, rng: random.Random, taken: set[str], n: int = 8) -> None:
        """Background mail: colleagues' notes, newsletters and a few invoices."""
        for _ in range(n):
            name, addr = person(rng, taken)
            topic = rng.choice(TOPICS)
            self.deliver(addr, name, f"{topic.capitalize()} - {rng.choice(('update', 'question', 'notes'))}",
                         f"Hi {self.my_name.split()[0]},\n\nA quick note on the {topic}. {rng.choice(FILLER)}\n\n{name}",
                         rng.randint(1, self.clock.day), ("work",))
        for _ in range(rng.randint(0, 2)):
            self.newsletter(rng)

    def newsletter(self, rng: random.Random, day: int | None = None) -> str:
        brand = rng.choice(BRANDS)
        return self.deliver(f"news@{brand.lower().replace(' ', '')}.com", brand,
                            f"{brand} #{rng.randint(10, 400)}: {rng.choice(TOPICS)}", "This week's top stories ...",
                            rng.randint(1, self.clock.day) if day is None else day, ("newsletter",))

    def invoice(self, rng: random.Random, day: int) -> str:
        vendor = rng.choice(VENDORS)
        num, amount = rng.randint(1000, 9999), rng.randint(40, 3000)
        return self.deliver(f"billing@{vendor}.com", vendor.capitalize(), f"Invoice INV-{num}",
                            f"Invoice INV-{num}: {amount} EUR, due in 30 days.", day, ("invoice",))

    # ------------------------------------------------------------------ tools
    def specs(self):
        return [
            spec("search_emails", "Search mail (newest first); all filters optional.",
                 {"query": S("words in subject/body/sender"), "sender": S("part of the sender's address or name"),
                  "label": S("label name"), "folder": S("folder", enum=[*FOLDERS, "all"])}),
            spec("read_email", "Read one email in full.", {"email_id": S("id, e.g. m3")}, ("email_id",)),
            spec("send_email", "Send a new email.", {"to": A("recipients", S("address")), "subject": S("subject"),
                 "body": S("text", MAX_TEXT), "cc": A("cc recipients", S("address"))}, ("to", "subject", "body")),
            spec("reply_email", "Reply to an email's sender (reply_all adds the other recipients).",
                 {"email_id": S("id"), "body": S("text", MAX_TEXT), "reply_all": B("include all recipients")},
                 ("email_id", "body")),
            spec("forward_email", "Forward an email.", {"email_id": S("id"), "to": A("recipients", S("address")),
                 "note": S("text above the forwarded mail", MAX_TEXT)}, ("email_id", "to")),
            spec("add_label", "Add a label to an email.", {"email_id": S("id"), "label": S("label", 40)},
                 ("email_id", "label")),
            spec("archive_email", "Move an email to the archive.", {"email_id": S("id")}, ("email_id",)),
            spec("delete_email", "Move an email to the trash.", {"email_id": S("id")}, ("email_id",)),
            spec("create_draft", "Save a draft without sending.", {"to": A("recipients", S("address")),
                 "subject": S("subject"), "body": S("text", MAX_TEXT)}, ("to", "subject", "body")),
        ]

    def _msg(self, email_id: str) -> dict:
        return get(self.msgs, email_id, "email", "Use search_emails to find email ids.")

    def t_search_emails(self, query="", sender="", label="", folder="inbox"):
        hits = [m for m in self.msgs.values()
                if (folder == "all" and m["folder"] != "trash" or m["folder"] == folder)
                and (not query or any(has(m[k], query) for k in ("subject", "body", "from_name", "from")))
                and (not sender or has(m["from"], sender) or has(m["from_name"], sender))
                and (not label or label in m["labels"])]
        hits.sort(key=lambda m: (-m["day"], m["id"]))
        rows = [{"id": m["id"], "from": m["from_name"] + " <" + m["from"] + ">", "subject": m["subject"],
                 "date": fmt_day(m["day"]), "labels": m["labels"]} for m in hits[:MAX_LIST]]
        return {"results": rows, "total": len(hits)}

    def t_read_email(self, email_id):
        m = self._msg(email_id)
        return {k: (fmt_day(v) if k == "day" else v) for k, v in m.items() if v not in (None, [])}

    def _addresses(self, addrs: list[str], field: str) -> list[str]:
        bad = [a for a in addrs if not EMAIL_RE.match(a)]
        if bad:
            raise ToolError(f"{field}: not an email address: {bad[0]!r} (use name@domain)")
        return list(addrs)

    def _send(self, to, subject, body, cc=(), folder="sent", **links) -> dict:
        to = self._addresses(to, "to")
        if not to:
            raise ToolError("to: at least one recipient is required")
        mid = self.new_id("m")
        self.msgs[mid] = {"id": mid, "from": self.me, "from_name": self.my_name, "to": to,
                          "cc": self._addresses(list(cc), "cc"), "subject": subject, "body": body, "labels": [],
                          "day": self.clock.day, "folder": folder, "reply_to": None, "forward_of": None, **links}
        return {"status": "saved" if folder == "drafts" else "sent", "email_id": mid}

    def t_send_email(self, to, subject, body, cc=()):
        return self._send(to, subject, body, cc)

    def t_create_draft(self, to, subject, body):
        return self._send(to, subject, body, folder="drafts")

    def t_reply_email(self, email_id, body, reply_all=False):
        m = self._msg(email_id)
        others = [a for a in m["to"] + m["cc"] if a != self.me] if reply_all else []
        subject = m["subject"] if m["subject"].startswith("Re:") else "Re: " + m["subject"]
        return self._send([m["from"]], subject, body, others, reply_to=email_id)

    def t_forward_email(self, email_id, to, note=""):
        m = self._msg(email_id)
        body = f"{note}\n\n---------- Forwarded message ----------\nFrom: {m['from']}\n{m['body']}".strip()
        return self._send(to, "Fwd: " + m["subject"], body, forward_of=email_id)

    def t_add_label(self, email_id, label):
        m = self._msg(email_id)
        if label not in m["labels"]:
            m["labels"].append(label)
        return {"email_id": email_id, "labels": m["labels"]}

    def _move(self, email_id, folder):
        m = self._msg(email_id)
        m["folder"] = folder
        return {"email_id": email_id, "folder": folder}

    def t_archive_email(self, email_id):
        return self._move(email_id, "archive")

    def t_delete_email(self, email_id):
        return self._move(email_id, "trash")

    def entities(self):
        return self.msgs

    # ------------------------------------------------------------------ verifier helpers
    def sent(self, **want) -> list[dict]:
        """Messages the user sent (not in `before`) whose fields equal `want`."""
        return [m for m in self.msgs.values() if m["folder"] == "sent"
                and all(m.get(k) == v for k, v in want.items())]


def keys(msgs) -> set[str]:
    return {f"mail:{m['id']}" for m in msgs}


def find_id(result, **want) -> str:
    """Id of the first search row matching `want` (substring match on strings)."""
    for row in result["results"]:
        if all(has(row.get(k, ""), v) for k, v in want.items()):
            return row["id"]
    raise LookupError(f"no search row matching {want}")


# ---------------------------------------------------------------------------------- families
def reply_family(w: "MailWorld", rng: random.Random) -> Task:
    mail, taken = w.apps["mail"], w.taken
    name, addr = person(rng, taken)
    topic, other = rng.sample(TOPICS, 2)
    fact, needles = make_fact(rng)
    target = mail.deliver(addr, name, f"Question about the {topic}", f"Hi, what's the plan for the {topic}? {name}",
                          rng.randint(5, 9))
    mail.deliver(addr, name, f"{other.capitalize()}", f"Some thoughts on the {other}.", rng.randint(1, 9))
    first = name.split()[0]
    instruction = rng.choice((f"Reply to {name}'s email about the {topic} and tell them {fact}.",
                              f"{first} emailed me about the {topic}. Answer them: {fact}.",
                              f"Please respond to the {topic} question from {name}; say that {fact}."))

    def verify():
        replies = mail.sent(reply_to=target)
        r = replies[0] if len(replies) == 1 else None
        return ({"one reply to the right email": r is not None,
                 "sent only to the asker": bool(r) and r["to"] == [addr] and not r["cc"],
                 "reply states the fact": bool(r) and all(has(r["body"], n) for n in needles)}, keys(replies))

    def public():
        ok = bool(mail.sent(reply_to=target))
        return ok, "a reply to the email was sent" if ok else f"no reply to {first}'s email about the {topic} yet"

    def solve():
        res = yield Call("search_emails", {"sender": first, "query": topic},
                         f"I need to find the email from {first} about the {topic} first.")
        mid = find_id(res, subject=f"question about the {topic}")
        yield Call("reply_email", {"email_id": mid, "body": f"Hi {first},\n\n{fact[0].upper() + fact[1:]}.\n\nBest,\n{w.my_name}"},
                   f"That's {mid}; I'll reply saying {fact}.")
        return f"I replied to {first} and told them {fact}."

    def hack():
        yield Call("reply_email", {"email_id": target, "body": "Noted."})
        return "Done."

    return Task("reply", 1, instruction, verify, public, solve, hack)


def archive_family(w: "MailWorld", rng: random.Random) -> Task:
    mail = w.apps["mail"]
    news = [mail.newsletter(rng) for _ in range(rng.randint(2, 4))]
    news = [m for m in mail.msgs if "newsletter" in mail.msgs[m]["labels"]]
    brands = sorted({mail.msgs[m]["from_name"] for m in news})
    instruction = rng.choice((f"Archive all the newsletters in my inbox ({', '.join(brands)}).",
                              f"My inbox is cluttered: move every newsletter to the archive (don't delete them). "
                              f"I count {len(news)} of them.",
                              f"Clean up: archive the {' and '.join(brands)} newsletter emails, leave everything else where it is."))

    def verify():
        return ({"every newsletter archived": all(mail.msgs[m]["folder"] == "archive" for m in news)}, keys(
            mail.msgs[m] for m in news))

    def public():
        left = [m for m in news if mail.msgs[m]["folder"] == "inbox"]
        return not left, f"{len(left)} newsletters still in the inbox"

    def solve():
        res = yield Call("search_emails", {"label": "newsletter"}, "Let me list the newsletters in the inbox.")
        ids = [r["id"] for r in res["results"]]
        for i, mid in enumerate(ids):
            yield Call("archive_email", {"email_id": mid}, f"Archiving {len(ids)} newsletters." if i == 0 else "")
        return f"Archived {len(ids)} newsletters."

    def hack():
        for mid in news:
            yield Call("delete_email", {"email_id": mid})
        return "Done."

    return Task("archive_newsletters", 1, instruction, verify, public, solve, hack)


def send_family(w: "MailWorld", rng: random.Random) -> Task:
    mail = w.apps["mail"]
    (name, addr), (cc_name, cc_addr) = person(rng, w.taken), person(rng, w.taken)
    topic = rng.choice(TOPICS)
    fact, needles = make_fact(rng)
    subject = f"{topic.capitalize()} {rng.choice(('plan', 'details', 'next steps', 'update'))}"
    instruction = rng.choice((
        f"Send an email to {name} ({addr}) with the subject \"{subject}\" saying that {fact}. CC {cc_name} ({cc_addr}).",
        f"Email {addr} (subject: {subject}) to let them know {fact}; put {cc_addr} in cc."))

    def verify():
        sent = mail.sent(subject=subject)
        m = sent[0] if len(sent) == 1 else None
        return ({"one email with the subject": m is not None,
                 "recipients": bool(m) and m["to"] == [addr] and m["cc"] == [cc_addr],
                 "states the fact": bool(m) and all(has(m["body"], n) for n in needles)}, keys(sent))

    def public():
        ok = any(addr in m["to"] for m in mail.sent())
        return ok, "an email to the recipient was sent" if ok else "nothing sent to the recipient yet"

    def solve():
        yield Call("send_email", {"to": [addr], "cc": [cc_addr], "subject": subject,
                                  "body": f"Hi {name.split()[0]},\n\n{fact[0].upper() + fact[1:]}.\n\nBest,\n{w.my_name}"},
                   f"I'll email {name} with {cc_name} in cc.")
        return f"Sent \"{subject}\" to {name}, cc {cc_name}."

    def hack():
        yield Call("send_email", {"to": [addr], "subject": "hi", "body": "hi"})
        return "Done."

    return Task("send_cc", 2, instruction, verify, public, solve, hack)


def forward_family(w: "MailWorld", rng: random.Random) -> Task:
    mail, today = w.apps["mail"], w.clock.day
    k = rng.randint(5, 10)
    recent = [mail.invoice(rng, today - rng.randint(0, k - 1)) for _ in range(rng.randint(2, 4))]
    for _ in range(rng.randint(1, 3)):
        mail.invoice(rng, today - rng.randint(k + 2, k + 14))
    team = rng.choice(("accounting", "finance", "bookkeeping", "payables"))
    target = f"{team}@{rng.choice(ORGS)}"
    instruction = rng.choice((f"Forward all invoices from the last {k} days to {target}.",
                              f"{team.capitalize()} ({target}) needs recent invoices: forward each invoice I got in the "
                              f"last {k} days to them, nothing older.",
                              f"Send every invoice received since {fmt_day(today - k + 1)} to {target} (forward them)."))

    def verify():
        fwd = [m for m in mail.sent() if m["forward_of"]]
        got = sorted(m["forward_of"] for m in fwd if m["to"] == [target])
        return ({"each recent invoice forwarded once": got == sorted(recent),
                 "only to accounting": all(m["to"] == [target] for m in fwd)}, keys(fwd))

    def public():
        ok = any(m["forward_of"] and target in m["to"] for m in mail.sent())
        return ok, "an invoice was forwarded to accounting" if ok else "nothing forwarded to accounting yet"

    def solve():
        res = yield Call("search_emails", {"label": "invoice"}, "First I list the invoices with their dates.")
        cutoff = fmt_day(today - k + 1)
        ids = [r["id"] for r in res["results"] if r["date"] >= cutoff]
        for i, mid in enumerate(ids):
            yield Call("forward_email", {"email_id": mid, "to": [target]},
                       f"{len(ids)} invoices are dated {cutoff} or later; forwarding them." if i == 0 else "")
        return f"Forwarded {len(ids)} invoices to {target}."

    def hack():
        yield Call("forward_email", {"email_id": recent[0], "to": [target]})
        return "Done."

    return Task("forward_invoices", 2, instruction, verify, public, solve, hack)


def label_family(w: "MailWorld", rng: random.Random) -> Task:
    mail = w.apps["mail"]
    org = rng.choice(ORGS)
    label = rng.choice(("client", "follow-up", "important", "partner", "vendor", "priority", "later", "review",
                        org.split(".")[0], f"{org.split('.')[0]}-team"))
    for _ in range(rng.randint(2, 3)):
        name, addr = person(rng, w.taken)
        addr = addr.split("@")[0] + "@" + org
        mail.deliver(addr, name, f"{rng.choice(TOPICS).capitalize()}", "See attached.", rng.randint(1, 10))
    targets = [m for m, v in mail.msgs.items() if v["from"].endswith("@" + org)]
    instruction = rng.choice((f"Label every email from people at {org} with \"{label}\".",
                              f"Add the label \"{label}\" to all mail sent from the {org} domain.",
                              f"Everything in my inbox from @{org} should carry the label {label}. Please add it."))

    def verify():
        return ({"all labelled": all(label in mail.msgs[m]["labels"] for m in targets)},
                keys(mail.msgs[m] for m in targets))

    def public():
        ok = any(label in m["labels"] for m in mail.msgs.values())
        return ok, f"some email has the label {label}" if ok else f"no email has the label {label} yet"

    def solve():
        res = yield Call("search_emails", {"sender": "@" + org}, f"I'll find all mail from {org}.")
        for i, row in enumerate(res["results"]):
            yield Call("add_label", {"email_id": row["id"], "label": label}, "Labelling each of them." if i == 0 else "")
        return f"Labelled {res['total']} emails from {org} as {label}."

    def hack():
        yield Call("add_label", {"email_id": targets[0], "label": label})
        return "Done."

    return Task("label_domain", 2, instruction, verify, public, solve, hack)


def relay_family(w: "MailWorld", rng: random.Random) -> Task:
    mail = w.apps["mail"]
    (xn, xa), (yn, ya) = person(rng, w.taken), person(rng, w.taken)
    topic = rng.choice(TOPICS)
    thing, code = rng.choice((("PO number", f"PO-{rng.randint(10000, 99999)}"), ("door code", str(rng.randint(1000, 9999))),
                              ("booking reference", f"BK{rng.randint(100000, 999999)}")))
    mail.deliver(xa, xn, f"{topic.capitalize()} logistics", f"Hi,\n\nFor the {topic}, the {thing} is {code}.\n\n{xn}", rng.randint(1, 8))
    ask = mail.deliver(ya, yn, f"Need the {thing}", f"Hi, could you send me the {thing} for the {topic}? Thanks, {yn}", 9)
    xf, yf = xn.split()[0], yn.split()[0]
    instruction = rng.choice((f"{yn} asked me for the {thing}. It's in {xn}'s email about the {topic}; reply to {yf} with it.",
                              f"Find the {thing} for the {topic} in my mail and answer {yn}'s request with it."))

    def verify():
        replies = mail.sent(reply_to=ask)
        r = replies[0] if len(replies) == 1 else None
        return ({"one reply to the request": r is not None, "sent only to the asker": bool(r) and r["to"] == [ya],
                 "contains the value": bool(r) and has(r["body"], code)}, keys(replies))

    def public():
        ok = bool(mail.sent(reply_to=ask))
        return ok, "the request was answered" if ok else f"{yf}'s request is unanswered"

    def solve():
        res = yield Call("search_emails", {"query": thing, "sender": yf}, f"Let me find {yf}'s request first.")
        ask_id = find_id(res, subject=thing)
        res = yield Call("search_emails", {"query": topic, "sender": xf}, f"Now the email from {xf} with the {thing}.")
        msg = yield Call("read_email", {"email_id": find_id(res, subject=f"{topic} logistics")}, "I'll read it to get the value.")
        value = re.search(rf"the {thing} is (\S+)\.", msg["body"]).group(1)
        yield Call("reply_email", {"email_id": ask_id, "body": f"Hi {yf},\n\nThe {thing} for the {topic} is {value}.\n\nBest,\n{w.my_name}"},
                   f"The {thing} is {value}; replying to {yf}.")
        return f"Sent {yf} the {thing} ({value})."

    def hack():
        yield Call("reply_email", {"email_id": ask, "body": "Will check."})
        return "Done."

    return Task("relay_fact", 3, instruction, verify, public, solve, hack)


def to_notes_family(w: "MailWorld", rng: random.Random) -> Task:
    """Multi-app (mail + notes): the action items of an email become Tasks rows."""
    mail, notes = w.apps["mail"], NotesApp(w.clock, w.me, w.my_name)
    notes.populate(rng)
    w.apps["notes"] = notes
    (xn, xa), topic = person(rng, w.taken), rng.choice(TOPICS)
    items, existing = [], notes.task_names()
    while len(items) < rng.randint(2, 3):
        what = f"{rng.choice(VERBS).capitalize()} {rng.choice(OBJECTS)}"
        if what not in existing and what not in [i[0] for i in items]:
            items.append((what, rng.choice(FIRST), fmt_day(w.clock.day + rng.randint(2, 12))))
    lines = "\n".join(f"- {o}: {t} (due {d})" for t, o, d in items)
    mail.deliver(xa, xn, f"Action items: {topic}", f"Hi,\n\nAction items from the {topic} meeting:\n{lines}\n\n{xn}", 9)
    before, xf = set(notes.dbs["tasks"]["rows"]), xn.split()[0]
    instruction = rng.choice((f"Put the action items from {xn}'s email about the {topic} into my Tasks database (owner, due date, status Todo).",
                              f"{xf} mailed the {topic} action items. Add one Tasks row per item with its owner and due date, status Todo."))

    def verify():
        new = notes.new_rows("tasks", before)
        match = lambda i, c: has(c["Name"], i[0]) and c["Owner"] == i[1] and c["Due"] == i[2] and c["Status"] == "Todo"
        return {"one row per item": len(new) == len(items),
                "rows match the items": all(any(match(i, c) for c in new.values()) for i in items)}, {f"notes:row:tasks:{r}" for r in new}

    def public():
        n = len(notes.new_rows("tasks", before))
        return n > 0, f"{n} rows added"

    def solve():
        res = yield Call("search_emails", {"sender": xf, "query": "Action items"}, f"First I open {xf}'s email with the action items.")
        msg = yield Call("read_email", {"email_id": find_id(res, subject=topic)})
        found = re.findall(r"^- (\w+): (.+) \(due (\S+)\)$", msg["body"], re.M)
        for i, (owner, what, due) in enumerate(found):
            yield Call("add_row", {"database_id": "tasks", "cells": {"Name": what, "Owner": owner, "Status": "Todo", "Due": due}},
                       f"{len(found)} items; adding each to the Tasks database." if i == 0 else "")
        return f"Added {len(found)} action items to Tasks."

    def hack():
        yield Call("add_row", {"database_id": "tasks", "cells": {"Name": f"{topic} action items"}})
        return "Done."

    return Task("mail_to_notes", 3, instruction, verify, public, solve, hack)


class MailWorld(AppWorld):
    world = "mail"
    families = (reply_family, archive_family, send_family, forward_family, label_family, relay_family, to_notes_family)

    def make_apps(self, rng):
        self.taken: set[str] = set()
        mail = MailApp(self.clock, self.me, self.my_name)
        mail.populate(rng, self.taken, rng.randint(5, 9))
        self.apps["mail"] = mail
