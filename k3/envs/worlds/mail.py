"""Mail world: tasks over the mail app (`k3.envs.worlds.apps.mail`).

Task families: reply with a fact (d1), archive newsletters (d1), send with cc (d2), forward the
last days' invoices (d2), label a domain's mail (d2), relay a fact from one thread into another
(d3), turn an email's action items into rows of the notes app's Tasks database (d3, multi-app).
"""

from __future__ import annotations

import random
import re

from k3.envs.worlds.apps.mail import MailApp, find_id, keys
from k3.envs.worlds.apps.notes import OBJECTS, VERBS, NotesApp
from k3.envs.worlds.common import FIRST, ORGS, TOPICS, AppWorld, Call, Task, fmt_day, has, make_fact, person

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
        yield Call(
            "reply_email",
            {"email_id": mid, "body": f"Hi {first},\n\n{fact[0].upper() + fact[1:]}.\n\nBest,\n{w.my_name}"},
            f"That's {mid}; I'll reply saying {fact}.",
        )
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
    instruction = rng.choice(
        (
            f"Archive all the newsletters in my inbox ({', '.join(brands)}).",
            f"My inbox is cluttered: move every newsletter to the archive (don't delete them). "
            f"I count {len(news)} of them.",
            f"Clean up: archive the {' and '.join(brands)} newsletter emails, leave everything else where it is.",
        )
    )

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
    instruction = rng.choice(
        (
            f'Send an email to {name} ({addr}) with the subject "{subject}" saying that {fact}. CC {cc_name} '
            f'({cc_addr}).',
            f"Email {addr} (subject: {subject}) to let them know {fact}; put {cc_addr} in cc.",
        )
    )

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
        yield Call(
            "send_email",
            {
                "to": [addr],
                "cc": [cc_addr],
                "subject": subject,
                "body": f"Hi {name.split()[0]},\n\n{fact[0].upper() + fact[1:]}.\n\nBest,\n{w.my_name}",
            },
            f"I'll email {name} with {cc_name} in cc.",
        )
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
    instruction = rng.choice(
        (
            f"Forward all invoices from the last {k} days to {target}.",
            f"{team.capitalize()} ({target}) needs recent invoices: forward each invoice I got in the "
            f"last {k} days to them, nothing older.",
            f"Send every invoice received since {fmt_day(today - k + 1)} to {target} (forward them).",
        )
    )

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
            yield Call(
                "add_label", {"email_id": row["id"], "label": label}, "Labelling each of them." if i == 0 else ""
            )
        return f"Labelled {res['total']} emails from {org} as {label}."

    def hack():
        yield Call("add_label", {"email_id": targets[0], "label": label})
        return "Done."

    return Task("label_domain", 2, instruction, verify, public, solve, hack)


def relay_family(w: "MailWorld", rng: random.Random) -> Task:
    mail = w.apps["mail"]
    (xn, xa), (yn, ya) = person(rng, w.taken), person(rng, w.taken)
    topic = rng.choice(TOPICS)
    thing, code = rng.choice(
        (
            ("PO number", f"PO-{rng.randint(10000, 99999)}"),
            ("door code", str(rng.randint(1000, 9999))),
            ("booking reference", f"BK{rng.randint(100000, 999999)}"),
        )
    )
    mail.deliver(
        xa,
        xn,
        f"{topic.capitalize()} logistics",
        f"Hi,\n\nFor the {topic}, the {thing} is {code}.\n\n{xn}",
        rng.randint(1, 8),
    )
    ask = mail.deliver(
        ya, yn, f"Need the {thing}", f"Hi, could you send me the {thing} for the {topic}? Thanks, {yn}", 9
    )
    xf, yf = xn.split()[0], yn.split()[0]
    instruction = rng.choice(
        (
            f"{yn} asked me for the {thing}. It's in {xn}'s email about the {topic}; reply to {yf} with it.",
            f"Find the {thing} for the {topic} in my mail and answer {yn}'s request with it.",
        )
    )

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
        msg = yield Call(
            "read_email", {"email_id": find_id(res, subject=f"{topic} logistics")}, "I'll read it to get the value."
        )
        value = re.search(rf"the {thing} is (\S+)\.", msg["body"]).group(1)
        yield Call(
            "reply_email",
            {"email_id": ask_id, "body": f"Hi {yf},\n\nThe {thing} for the {topic} is {value}.\n\nBest,\n{w.my_name}"},
            f"The {thing} is {value}; replying to {yf}.",
        )
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
    instruction = rng.choice(
        (
            f"Put the action items from {xn}'s email about the {topic} into my Tasks database (owner, due date, "
            "status Todo).",
            f"{xf} mailed the {topic} action items. Add one Tasks row per item with its owner and due date, status "
            "Todo.",
        )
    )

    def verify():
        new = notes.new_rows("tasks", before)
        match = lambda i, c: has(c["Name"], i[0]) and c["Owner"] == i[1] and c["Due"] == i[2] and c["Status"] == "Todo"
        return {
            "one row per item": len(new) == len(items),
            "rows match the items": all(any(match(i, c) for c in new.values()) for i in items),
        }, {f"notes:row:tasks:{r}" for r in new}

    def public():
        n = len(notes.new_rows("tasks", before))
        return n > 0, f"{n} rows added"

    def solve():
        res = yield Call(
            "search_emails",
            {"sender": xf, "query": "Action items"},
            f"First I open {xf}'s email with the action items.",
        )
        msg = yield Call("read_email", {"email_id": find_id(res, subject=topic)})
        found = re.findall(r"^- (\w+): (.+) \(due (\S+)\)$", msg["body"], re.M)
        for i, (owner, what, due) in enumerate(found):
            yield Call(
                "add_row",
                {"database_id": "tasks", "cells": {"Name": what, "Owner": owner, "Status": "Todo", "Due": due}},
                f"{len(found)} items; adding each to the Tasks database." if i == 0 else "",
            )
        return f"Added {len(found)} action items to Tasks."

    def hack():
        yield Call("add_row", {"database_id": "tasks", "cells": {"Name": f"{topic} action items"}})
        return "Done."

    tools = frozenset(t.name for t in mail.specs()) | {"search_pages", "query_database", "add_row", "update_row"}
    return Task("mail_to_notes", 3, instruction, verify, public, solve, hack, tools=tools)


class MailWorld(AppWorld):
    world = "mail"
    families = (reply_family, archive_family, send_family, forward_family, label_family, relay_family, to_notes_family)

    def make_apps(self, rng):
        self.taken: set[str] = set()
        mail = MailApp(self.clock, self.me, self.my_name)
        mail.populate(rng, self.taken, rng.randint(5, 9))
        self.apps["mail"] = mail
