"""The chat app (Slack-like): channels, threads, reactions and direct messages.

State: `ChatApp.users` handle -> full name (handles are unique first names, lower case);
`channels` name -> {private, members}; `msgs` id -> {id, channel ("#name" or "@handle" for a DM
with that user), user, text, day, parent (thread root id or None), reactions {emoji: [handles]}}.
"""

from __future__ import annotations

import random
import re

from k3.envs.worlds.common import (FIRST, LAST, MAX_LIST, MAX_TEXT, TOPICS, App, B, I, S, ToolError, fmt_day, get,
                                   has, spec)

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
            spec(
                "read_channel",
                "Latest top-level messages of a channel (oldest first).",
                {"channel": ch, "limit": I("how many", 1, 30)},
                ("channel",),
            ),
            spec(
                "read_thread",
                "A message and its thread replies.",
                {"channel": ch, "message_id": mid},
                ("channel", "message_id"),
            ),
            spec("search_messages", "Search messages in all channels.", {"query": S("words")}, ("query",)),
            spec(
                "post_message",
                "Post a top-level message in a channel.",
                {"channel": ch, "text": S("text", MAX_TEXT)},
                ("channel", "text"),
            ),
            spec(
                "reply_in_thread",
                "Reply in a message's thread.",
                {"channel": ch, "message_id": mid, "text": S("text", MAX_TEXT)},
                ("channel", "message_id", "text"),
            ),
            spec(
                "add_reaction",
                "React to a message with an emoji name.",
                {"channel": ch, "message_id": mid, "emoji": S("emoji name without colons", 40)},
                ("channel", "message_id", "emoji"),
            ),
            spec(
                "create_channel",
                "Create a channel (you join it).",
                {"name": S("lowercase name, letters/digits/-", 40), "private": B("private channel")},
                ("name",),
            ),
            spec(
                "invite_user",
                "Invite a user to a channel.",
                {"channel": ch, "user": S("user handle")},
                ("channel", "user"),
            ),
            spec(
                "send_dm",
                "Send a direct message to a user.",
                {"user": S("user handle"), "text": S("text", MAX_TEXT)},
                ("user", "text"),
            ),
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
        emoji = emoji.strip(":")
        if not re.fullmatch(r"[a-z0-9_+-]{1,40}", emoji):
            raise ToolError(f"invalid emoji name {emoji!r}: use a name like thumbsup or white_check_mark")
        who = m["reactions"].setdefault(emoji, [])
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
        return [
            {"id": m["id"], "from": m["user"], "text": m["text"]} for m in self.msgs.values() if m["channel"] == conv
        ]

    def entities(self):
        return {**{"#" + n: c for n, c in self.channels.items()}, **self.msgs}

    def mine(self, channel: str, parent: str | None = None) -> list[dict]:
        """My messages in `channel` (top level when parent is None) — verifier helper."""
        return [m for m in self.msgs.values() if m["user"] == self.handle and m["channel"] == channel
                and m["parent"] == parent]


def keys(msgs) -> set[str]:
    """Entity keys of messages (channels are keyed "chat:#name")."""
    return {f"chat:{m['id']}" for m in msgs}
