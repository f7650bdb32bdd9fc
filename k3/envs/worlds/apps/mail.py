"""The mail app (Gmail-like): folders, labels, send / reply / forward / drafts.

State: `MailApp.msgs` id -> {id, from, from_name, to, cc, subject, body, labels, day, folder,
reply_to, forward_of}; folders inbox / archive / sent / drafts / trash. `populate` fills the inbox
with colleagues' notes and newsletters; `deliver`, `newsletter`, `invoice` plant task data.
"""

from __future__ import annotations

import random
import re

from k3.envs.worlds.common import (MAX_LIST, MAX_TEXT, TOPICS, A, App, B, S, ToolError, fmt_day, get, has, person,
                                   spec)

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
            self.deliver(
                addr,
                name,
                f"{topic.capitalize()} - {rng.choice(('update', 'question', 'notes'))}",
                f"Hi {self.my_name.split()[0]},\n\nA quick note on the {topic}. {rng.choice(FILLER)}\n\n{name}",
                rng.randint(1, self.clock.day),
                ("work",),
            )
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
        out = {k: v for k, v in m.items() if v not in (None, []) and k != "day"}
        return {**out, "date": fmt_day(m["day"])}

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
