"""Chat world (Slack-like): channels, threads, reactions and direct messages.

State: `ChatApp.users` handle -> full name (handles are unique first names, lower case);
`channels` name -> {private, members}; `msgs` id -> {id, channel ("#name" or "@handle" for a DM
with that user), user, text, day, parent (thread root id or None), reactions {emoji: [handles]}}.
Task families: post a fact (d1), react to a message (d1), create a channel and invite (d2), answer
a thread with a value from another channel (d2), DM the yes-RSVPs of a thread (d3), invite the
people who reacted to an announcement (d3), email a channel's decision to an outsider (d3,
multi-app with mail).
"""

from __future__ import annotations

import random
import re

from k3.envs.worlds.common import (FIRST, LAST, MAX_LIST, MAX_TEXT, TOPICS, App, AppWorld, B, Call, I, S, Task,
                                   ToolError, fmt_day, get, has, make_fact, person, spec)
from k3.envs.worlds.mail import MailApp

CHANNELS = ("general", "random", "engineering", "design", "marketing", "support", "ops", "sales")
EMOJI = ("thumbsup", "eyes", "tada", "white_check_mark", "heart", "rocket")
CHATTER = ("Morning all!", "Has anyone seen the {t} doc?", "Reminder: the {t} is this week.",
           "I pushed an update for the {t}.", "Lunch at 12?", "Notes from the {t} are in the drive.")
YES = ("I'm in!", "Count me in.", "Yes, I'll be there.", "Sounds great, see you there.")
NO = ("Can't make it, sorry.", "I'm away that day.", "No, I have a conflict.", "Not this time.")


class ChatApp(App):
    name = "chat"

    def __init__(self, clock, me, my_name):
        super().__init__(clock, me, my_name)
        self.handle = my_name.split()[0].lower()
        self.users: dict[str, str] = {self.handle: my_name}
        self.channels: dict[str, dict] = {}
        self.msgs: dict[str, dict] = {}

    # ------------------------------------------------------------------ content
    def add_users(self, rng: random.Random, n: int) -> list[str]:
        free = [f for f in FIRST if f.lower() not in self.users]
        new = rng.sample(free, min(n, len(free)))
        for f in new:
            self.users[f.lower()] = f"{f} {rng.choice(LAST)}"
        return [f.lower() for f in new]

    def post(self, channel: str, user: str, text: str, parent: str | None = None, day: int | None = None) -> str:
        mid = self.new_id("t")
        self.msgs[mid] = {"id": mid, "channel": channel, "user": user, "text": text, "parent": parent,
                          "day": self.clock.day if day is None else day, "reactions": {}}
        return mid

    def populate(self, rng: random.Random) -> None:
        people = self.add_users(rng, rng.randint(6, 9))
        for name in rng.sample(CHANNELS, rng.randint(3, 5)):
            members = sorted({self.handle, *rng.sample(people, rng.randint(3, len(people)))})
            self.channels[name] = {"private": False, "members": members}
            for _ in range(rng.randint(1, 4)):
                self.post("#" + name, rng.choice([m for m in members if m != self.handle]),
                          rng.choice(CHATTER).format(t=rng.choice(TOPICS)), day=rng.randint(1, self.clock.day - 1))

    def others(self) -> list[str]:
        return [h for h in self.users if h != self.handle]

    # ------------------------------------------------------------------ tools
    def specs(self):
        ch, mid = S("channel name, e.g. general"), S("message id, e.g. t4")
        return [
            spec("list_channels", "Channels with member counts."),
            spec("list_users", "Workspace users: handle and full name."),
            spec("read_channel", "Latest top-level messages of a channel (oldest first).",
                 {"channel": ch, "limit": I("how many", 1, 30)}, ("channel",)),
            spec("read_thread", "A message and its thread replies.", {"channel": ch, "message_id": mid},
                 ("channel", "message_id")),
            spec("search_messages", "Search messages in all channels.", {"query": S("words")}, ("query",)),
            spec("post_message", "Post a top-level message in a channel.", {"channel": ch, "text": S("text", MAX_TEXT)},
                 ("channel", "text")),
            spec("reply_in_thread", "Reply in a message's thread.", {"channel": ch, "message_id": mid,
                 "text": S("text", MAX_TEXT)}, ("channel", "message_id", "text")),
            spec("add_reaction", "React to a message with an emoji name.", {"channel": ch, "message_id": mid,
                 "emoji": S("emoji name without colons", 40)}, ("channel", "message_id", "emoji")),
            spec("create_channel", "Create a channel (you join it).", {"name": S("lowercase name, letters/digits/-", 40),
                 "private": B("private channel")}, ("name",)),
            spec("invite_user", "Invite a user to a channel.", {"channel": ch, "user": S("user handle")},
                 ("channel", "user")),
            spec("send_dm", "Send a direct message to a user.", {"user": S("user handle"), "text": S("text", MAX_TEXT)},
                 ("user", "text")),
            spec("read_dms", "Your direct-message conversation with a user.", {"user": S("user handle")}, ("user",)),
        ]

    def _channel(self, channel: str) -> str:
        name = channel.lstrip("#")
        get(self.channels, name, "channel", "Use list_channels to see channel names.")
        return name

    def _user(self, user: str) -> str:
        handle = user.lstrip("@").lower()
        get(self.users, handle, "user", "Use list_users to see handles.")
        return handle

    def _message(self, channel: str, message_id: str) -> dict:
        m = get(self.msgs, message_id, "message", "Use read_channel or search_messages to find message ids.")
        if m["channel"] != "#" + self._channel(channel):
            raise ToolError(f"message {message_id} is in {m['channel']}, not #{channel.lstrip('#')}")
        return m

    def row(self, m: dict) -> dict:
        out = {"id": m["id"], "user": m["user"], "text": m["text"], "date": fmt_day(m["day"])}
        if m["reactions"]:
            out["reactions"] = m["reactions"]
        replies = sum(r["parent"] == m["id"] for r in self.msgs.values())
        if replies:
            out["replies"] = replies
        return out

    def t_list_channels(self):
        return [{"name": n, "members": len(c["members"]), "private": c["private"]} for n, c in self.channels.items()]

    def t_list_users(self):
        return [{"handle": h, "name": n} for h, n in self.users.items()]

    def t_read_channel(self, channel, limit=10):
        name = "#" + self._channel(channel)
        top = [m for m in self.msgs.values() if m["channel"] == name and m["parent"] is None]
        return [self.row(m) for m in top[-limit:]]

    def t_read_thread(self, channel, message_id):
        root = self._message(channel, message_id)
        return {"message": self.row(root), "replies": [{"id": r["id"], "user": r["user"], "text": r["text"]}
                                                       for r in self.msgs.values() if r["parent"] == message_id]}

    def t_search_messages(self, query):
        hits = [m for m in self.msgs.values() if m["channel"].startswith("#") and has(m["text"], query)]
        return [{"channel": m["channel"], **self.row(m)} for m in hits[-MAX_LIST:]]

    def t_post_message(self, channel, text):
        return {"message_id": self.post("#" + self._channel(channel), self.handle, text)}

    def t_reply_in_thread(self, channel, message_id, text):
        root = self._message(channel, message_id)
        if root["parent"]:
            raise ToolError(f"{message_id} is itself a reply; reply to the thread root {root['parent']}")
        return {"message_id": self.post(root["channel"], self.handle, text, parent=message_id)}

    def t_add_reaction(self, channel, message_id, emoji):
        m = self._message(channel, message_id)
        who = m["reactions"].setdefault(emoji.strip(":"), [])
        if self.handle not in who:
            who.append(self.handle)
        return {"message_id": message_id, "reactions": m["reactions"]}

    def t_create_channel(self, name, private=False):
        name = name.lstrip("#")
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,39}", name):
            raise ToolError(f"invalid channel name {name!r}: use lowercase letters, digits and '-'")
        if name in self.channels:
            raise ToolError(f"channel #{name} already exists")
        self.channels[name] = {"private": bool(private), "members": [self.handle]}
        return {"channel": name, "private": bool(private)}

    def t_invite_user(self, channel, user):
        name, handle = self._channel(channel), self._user(user)
        members = self.channels[name]["members"]
        if handle not in members:
            members.append(handle)
        return {"channel": name, "members": members}

    def t_send_dm(self, user, text):
        return {"message_id": self.post("@" + self._user(user), self.handle, text)}

    def t_read_dms(self, user):
        conv = "@" + self._user(user)
        return [{"id": m["id"], "from": m["user"], "text": m["text"]} for m in self.msgs.values() if m["channel"] == conv]

    def entities(self):
        return {**{"#" + n: c for n, c in self.channels.items()}, **self.msgs}

    def mine(self, channel: str, parent: str | None = None) -> list[dict]:
        """My messages in `channel` (top level when parent is None) — verifier helper."""
        return [m for m in self.msgs.values() if m["user"] == self.handle and m["channel"] == channel
                and m["parent"] == parent]


def keys(msgs) -> set[str]:
    """Entity keys of messages (channels are keyed "chat:#name")."""
    return {f"chat:{m['id']}" for m in msgs}


# ---------------------------------------------------------------------------------- families
def cap(text: str) -> str:
    return text[0].upper() + text[1:]


def post_family(w: "ChatWorld", rng: random.Random) -> Task:
    chat = w.apps["chat"]
    ch = rng.choice(list(chat.channels))
    fact, needles = make_fact(rng)
    topic = rng.choice(TOPICS)
    instruction = rng.choice((f"Post in #{ch} that {fact} (it's about the {topic}).",
                              f"Let the #{ch} channel know: for the {topic}, {fact}.",
                              f"Tell everyone in #{ch} that {fact}."))

    def verify():
        mine = chat.mine("#" + ch)
        m = mine[0] if len(mine) == 1 else None
        return {"one new post in the channel": m is not None,
                "post states the fact": bool(m) and all(has(m["text"], n) for n in needles)}, keys(mine)

    def public():
        ok = bool(chat.mine("#" + ch))
        return ok, f"you posted in #{ch}" if ok else f"nothing posted in #{ch} yet"

    def solve():
        yield Call("post_message", {"channel": ch, "text": f"Heads-up on the {topic}: {fact}."}, f"I'll post the note in #{ch}.")
        return f"Posted in #{ch}."

    def hack():
        yield Call("post_message", {"channel": ch, "text": "update"})
        return "Done."

    return Task("post", 1, instruction, verify, public, solve, hack)


def react_family(w: "ChatWorld", rng: random.Random) -> Task:
    chat = w.apps["chat"]
    ch = rng.choice(list(chat.channels))
    members = chat.channels[ch]["members"]
    author = rng.choice([u for u in members if u != chat.handle])
    topic = rng.choice(TOPICS)
    emoji = rng.choice(EMOJI)
    target = chat.post("#" + ch, author, f"The {topic} draft is ready for review.", day=w.clock.day)
    chat.post("#" + ch, rng.choice([u for u in members if u != chat.handle]), rng.choice(CHATTER).format(t=rng.choice(TOPICS)))
    name = chat.users[author].split()[0]
    instruction = rng.choice((f"React with :{emoji}: to {name}'s message about the {topic} in #{ch}.",
                              f"In #{ch}, {name} said the {topic} draft is ready. Add a {emoji} reaction to it."))

    def verify():
        return {"reaction on the message": chat.handle in chat.msgs[target]["reactions"].get(emoji, [])}, {f"chat:{target}"}

    def public():
        ok = any(chat.handle in m["reactions"].get(emoji, []) for m in chat.msgs.values() if m["channel"] == "#" + ch)
        return ok, f"a :{emoji}: from you is in #{ch}" if ok else f"no :{emoji}: from you in #{ch}"

    def solve():
        rows = yield Call("read_channel", {"channel": ch}, f"Let me find {name}'s message in #{ch}.")
        mid = next(r["id"] for r in rows if r["user"] == author and has(r["text"], f"{topic} draft"))
        yield Call("add_reaction", {"channel": ch, "message_id": mid, "emoji": emoji}, f"It's {mid}; adding :{emoji}:.")
        return f"Reacted with :{emoji}:."

    def hack():
        last = [m for m in chat.msgs.values() if m["channel"] == "#" + ch][-1]
        yield Call("add_reaction", {"channel": ch, "message_id": last["id"], "emoji": emoji})
        return "Done."

    return Task("react", 1, instruction, verify, public, solve, hack)


def channel_family(w: "ChatWorld", rng: random.Random) -> Task:
    chat = w.apps["chat"]
    name = f"{rng.choice(TOPICS).replace(' ', '-')}-{rng.randint(1, 99)}"
    invitees = sorted(rng.sample(chat.others(), rng.randint(2, 3)))
    private = rng.random() < 0.5
    names = ", ".join(chat.users[h] for h in invitees)
    kind = "private" if private else "public"
    instruction = rng.choice((f"Create a {kind} channel #{name} and invite {names}.",
                              f"Set up #{name} ({kind}) with {names} as members."))

    def verify():
        c = chat.channels.get(name)
        return {"channel exists": c is not None, "privacy": bool(c) and c["private"] == private,
                "exact members": bool(c) and sorted(c["members"]) == sorted([chat.handle, *invitees])}, {f"chat:#{name}"}

    def public():
        ok = name in chat.channels
        return ok, f"#{name} exists" if ok else f"#{name} does not exist yet"

    def solve():
        users = yield Call("list_users", {}, "I need the users' handles first.")
        handles = [u["handle"] for u in users if u["name"] in names.split(", ")]
        yield Call("create_channel", {"name": name, "private": private}, f"Creating the {kind} channel #{name}.")
        for h in handles:
            yield Call("invite_user", {"channel": name, "user": h}, f"Inviting {h}.")
        return f"Created #{name} and invited {names}."

    def hack():
        yield Call("create_channel", {"name": name})
        return "Done."

    return Task("create_channel", 2, instruction, verify, public, solve, hack)


def thread_family(w: "ChatWorld", rng: random.Random) -> Task:
    chat = w.apps["chat"]
    ch, src = rng.sample(list(chat.channels), 2)
    topic = rng.choice(TOPICS)
    thing, code = rng.choice((("ticket number", f"TCK-{rng.randint(1000, 9999)}"), ("wifi password", f"guest{rng.randint(100, 999)}"),
                              ("dial-in PIN", str(rng.randint(100000, 999999)))))
    asker, poster = rng.sample(chat.others(), 2)
    chat.post("#" + src, poster, f"FYI the {thing} for the {topic} is {code}", day=w.clock.day - 2)
    ask = chat.post("#" + ch, asker, f"Does anyone have the {thing} for the {topic}?")
    an = chat.users[asker].split()[0]
    instruction = rng.choice((f"{an} asked in #{ch} for the {thing} of the {topic}. It was posted in #{src}; answer in {an}'s thread.",
                              f"Answer {an}'s question in #{ch} (in the thread) with the {thing} for the {topic}; search the channels for it."))

    def verify():
        replies, top = chat.mine("#" + ch, ask), chat.mine("#" + ch)
        r = replies[0] if len(replies) == 1 else None
        return {"one thread reply": r is not None, "contains the value": bool(r) and has(r["text"], code),
                "no top-level post": not top}, keys(replies + top)

    def public():
        ok = bool(chat.mine("#" + ch, ask))
        return ok, f"you replied in {an}'s thread" if ok else f"{an}'s thread has no reply from you"

    def solve():
        hits = yield Call("search_messages", {"query": thing}, f"Let me search for the {thing}.")
        value = next(re.search(r" is (\S+)$", h["text"]).group(1) for h in hits if h["channel"] == "#" + src and has(h["text"], topic))
        rows = yield Call("read_channel", {"channel": ch}, f"The {thing} is {value}. Now I find {an}'s question.")
        mid = next(r["id"] for r in rows if r["user"] == asker and has(r["text"], thing))
        yield Call("reply_in_thread", {"channel": ch, "message_id": mid, "text": f"The {thing} for the {topic} is {value}."},
                   f"Replying in the thread of {mid}.")
        return f"Answered {an} in the thread."

    def hack():
        yield Call("reply_in_thread", {"channel": ch, "message_id": ask, "text": "Looking into it."})
        return "Done."

    return Task("thread_answer", 2, instruction, verify, public, solve, hack)


def rsvp_family(w: "ChatWorld", rng: random.Random) -> Task:
    chat = w.apps["chat"]
    ch = rng.choice(list(chat.channels))
    host, *crowd = rng.sample(chat.others(), rng.randint(4, min(7, len(chat.others()))))
    event = rng.choice(("team dinner", "offsite", "hackathon", "board game night", "volunteer day"))
    root = chat.post("#" + ch, host, f"Who's coming to the {event} on {rng.choice(('Friday', 'Thursday'))}? Reply here.")
    yes = sorted(rng.sample(crowd, rng.randint(1, len(crowd) - 1)))
    for u in crowd:
        chat.post("#" + ch, u, rng.choice(YES if u in yes else NO), parent=root)
    hn = chat.users[host].split()[0]
    instruction = rng.choice((f"{hn} asked in #{ch} who is coming to the {event}. DM {hn} the names of everyone who said yes.",
                              f"Count the yes replies in {hn}'s {event} thread in #{ch} and send {hn} a direct message listing those people."))

    def verify():
        dms = chat.mine("@" + host)
        d = dms[0] if len(dms) == 1 else None
        named = lambda u: bool(d) and (has(d["text"], chat.users[u].split()[0]) or has(d["text"], u))
        return {"one DM to the host": d is not None, "lists every yes": all(named(u) for u in yes),
                "lists no one else": not any(named(u) for u in crowd if u not in yes)}, keys(dms)

    def public():
        ok = bool(chat.mine("@" + host))
        return ok, f"you sent {hn} a DM" if ok else f"no DM to {hn} yet"

    def solve():
        rows = yield Call("read_channel", {"channel": ch}, f"First I find {hn}'s {event} message.")
        mid = next(r["id"] for r in rows if r["user"] == host and has(r["text"], event))
        thread = yield Call("read_thread", {"channel": ch, "message_id": mid}, "Now the replies in its thread.")
        going = [r["user"] for r in thread["replies"] if r["text"] in YES]
        names = [chat.users[u].split()[0] for u in going]
        yield Call("send_dm", {"user": host, "text": f"Coming to the {event}: {', '.join(names)}."},
                   f"{len(going)} said yes: {', '.join(names)}. Sending {hn} the list.")
        return f"Sent {hn} the list: {', '.join(names)}."

    def hack():
        yield Call("send_dm", {"user": host, "text": "See the thread."})
        return "Done."

    return Task("rsvp_dm", 3, instruction, verify, public, solve, hack)


def reacted_family(w: "ChatWorld", rng: random.Random) -> Task:
    chat = w.apps["chat"]
    ch = rng.choice(list(chat.channels))
    poster, *rest = rng.sample(chat.others(), rng.randint(4, min(7, len(chat.others()))))
    topic = rng.choice(TOPICS)
    emoji, other_emoji = rng.sample(EMOJI, 2)
    ann = chat.post("#" + ch, poster, f"Announcement: we're starting a working group on the {topic}. React with :{emoji}: to join.")
    joiners = sorted(rng.sample(rest, rng.randint(1, len(rest) - 1)))
    chat.msgs[ann]["reactions"] = {emoji: list(joiners), other_emoji: [u for u in rest if u not in joiners]}
    new = f"wg-{topic.split()[0]}-{rng.randint(1, 99)}"
    instruction = rng.choice((f"Create the channel #{new} and invite everyone who reacted with :{emoji}: to the {topic} announcement in #{ch}.",
                              f"People joined the {topic} working group by reacting :{emoji}: in #{ch}. Make #{new} and add exactly them."))

    def verify():
        c = chat.channels.get(new)
        return {"channel exists": c is not None,
                "members are the joiners": bool(c) and sorted(c["members"]) == sorted([chat.handle, *joiners])}, {f"chat:#{new}"}

    def public():
        ok = new in chat.channels and len(chat.channels[new]["members"]) > 1
        return ok, f"#{new} has members" if ok else f"#{new} missing or empty"

    def solve():
        rows = yield Call("read_channel", {"channel": ch}, f"Let me find the {topic} announcement in #{ch}.")
        row = next(r for r in rows if has(r["text"], topic) and has(r["text"], "working group"))
        who = row["reactions"][emoji]
        yield Call("create_channel", {"name": new}, f"{', '.join(who)} reacted with :{emoji}:. Creating #{new}.")
        for h in who:
            yield Call("invite_user", {"channel": new, "user": h})
        return f"Created #{new} with {', '.join(who)}."

    def hack():
        yield Call("create_channel", {"name": new})
        yield Call("invite_user", {"channel": new, "user": poster})
        return "Done."

    return Task("invite_reactors", 3, instruction, verify, public, solve, hack)


def to_mail_family(w: "ChatWorld", rng: random.Random) -> Task:
    """Multi-app (chat + mail): email a decision posted in a channel to someone outside the chat."""
    chat, mail = w.apps["chat"], MailApp(w.clock, w.me, w.my_name)
    taken = set(chat.users.values())
    mail.populate(rng, taken, rng.randint(3, 6))
    w.apps["mail"] = mail
    ch = rng.choice(list(chat.channels))
    topic = rng.choice(TOPICS)
    option = rng.choice((f"vendor {rng.choice(('Northwind', 'Contoso', 'Fabrikam', 'Tailspin'))}", f"the {rng.randint(3, 9)}-week timeline",
                         f"plan {rng.choice('ABC')}", f"a budget of {rng.randint(10, 90)}k EUR"))
    poster = rng.choice([u for u in chat.channels[ch]["members"] if u != chat.handle])
    chat.post("#" + ch, poster, f"Some options for the {topic} are on the table.", day=w.clock.day - 2)
    chat.post("#" + ch, poster, f"Decision on the {topic}: we go with {option}.", day=w.clock.day - 1)
    yn, ya = person(rng, taken)
    pn = chat.users[poster].split()[0]
    instruction = rng.choice((f"{pn} posted the decision about the {topic} in #{ch}. Email it to {yn} ({ya}).",
                              f"Let {yn} <{ya}> know by email what was decided on the {topic} (see #{ch})."))

    def verify():
        sent = mail.sent()
        m = sent[0] if len(sent) == 1 else None
        return {"one email": m is not None, "to the right person": bool(m) and m["to"] == [ya],
                "states the decision": bool(m) and has(m["subject"] + " " + m["body"], option)}, {f"mail:{x['id']}" for x in sent}

    def public():
        ok = any(ya in m["to"] for m in mail.sent())
        return ok, f"an email to {ya} was sent" if ok else f"nothing sent to {ya} yet"

    def solve():
        hits = yield Call("search_messages", {"query": f"Decision on the {topic}"}, f"Let me find the {topic} decision.")
        value = next(re.search(r"we go with (.+)\.$", h["text"]).group(1) for h in hits if h["channel"] == "#" + ch)
        yield Call("send_email", {"to": [ya], "subject": f"{topic.capitalize()} decision",
                                  "body": f"Hi {yn.split()[0]},\n\nFor the {topic}, we go with {value}.\n\nBest,\n{w.my_name}"},
                   f"The decision is {value}; emailing {yn}.")
        return f"Emailed {yn} the {topic} decision ({value})."

    def hack():
        yield Call("send_email", {"to": [ya], "subject": topic, "body": "See the chat."})
        return "Done."

    return Task("chat_to_mail", 3, instruction, verify, public, solve, hack)


class ChatWorld(AppWorld):
    world = "chat"
    families = (post_family, react_family, channel_family, thread_family, rsvp_family, reacted_family, to_mail_family)

    def make_apps(self, rng):
        chat = ChatApp(self.clock, self.me, self.my_name)
        chat.populate(rng)
        self.apps["chat"] = chat
