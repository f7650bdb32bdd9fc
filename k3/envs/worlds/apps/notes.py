"""The notes app (Notion-like): pages with blocks and tags, and databases (tables of rows).

State: `NotesApp.pages` id -> {id, title, parent, tags, blocks}; `dbs` id -> {id, title, columns,
rows: {row id -> {column -> value}}}; `populate` creates section pages, notes and a Tasks database
(Name, Owner, Status in Todo / In progress / Done, Due).
"""

from __future__ import annotations

import random
import re

from k3.envs.worlds.common import (FIRST, MAX_LIST, MAX_TEXT, TOPICS, A, App, S, ToolError, fmt_day, get, has,
                                   spec)

STATUSES = ("Todo", "In progress", "Done")
TASK_COLUMNS = ("Name", "Owner", "Status", "Due")
VERBS = ("draft", "review", "send", "update", "book", "prepare", "collect", "schedule")
OBJECTS = ("the agenda", "the budget sheet", "the venue", "the slides", "the contract", "the survey", "the invoices",
           "the release notes", "the travel plan", "the job ad")
TAGS = ("draft", "archive", "important", "q2", "reference", "meeting", "idea")
SECTIONS = ("Projects", "Team", "Archive", "Meetings", "Personal", "Clients")


class NotesApp(App):
    name = "notes"

    def __init__(self, clock, me, my_name):
        super().__init__(clock, me, my_name)
        self.pages: dict[str, dict] = {}
        self.dbs: dict[str, dict] = {}

    # ------------------------------------------------------------------ content
    def page(self, title: str, parent: str | None = None, tags=(), blocks=()) -> str:
        pid = self.new_id("p")
        self.pages[pid] = {"id": pid, "title": title, "parent": parent, "tags": list(tags), "blocks": list(blocks)}
        return pid

    def task_row(self, name: str, owner: str, status: str, due: int) -> str:
        rid = self.new_id("r")
        self.dbs["tasks"]["rows"][rid] = {"Name": name, "Owner": owner, "Status": status, "Due": fmt_day(due)}
        return rid

    def populate(self, rng: random.Random) -> None:
        self.sections = {s: self.page(s) for s in rng.sample(SECTIONS, 4)}
        for _ in range(rng.randint(4, 7)):
            topic = rng.choice(TOPICS)
            self.page(f"{topic.capitalize()} {rng.choice(('notes', 'plan', 'overview', 'ideas'))}",
                      rng.choice(list(self.sections.values())), rng.sample(TAGS, rng.randint(0, 2)),
                      [f"Notes on the {topic}."])
        self.dbs["tasks"] = {"id": "tasks", "title": "Tasks", "columns": list(TASK_COLUMNS), "rows": {}}
        self.owners = rng.sample(FIRST, 4)
        done = set()
        for _ in range(rng.randint(5, 8)):
            name = f"{rng.choice(VERBS).capitalize()} {rng.choice(OBJECTS)}"
            if name not in done:
                done.add(name)
                self.task_row(name, rng.choice(self.owners), rng.choice(STATUSES), self.clock.day + rng.randint(-5, 10))

    def task_names(self) -> set[str]:
        return {r["Name"] for r in self.dbs["tasks"]["rows"].values()}

    # ------------------------------------------------------------------ tools
    def specs(self):
        pid, db = S("page id, e.g. p3"), S("database id")
        return [
            spec("search_pages", "Find pages by words in title, tags or text.", {"query": S("words")}, ("query",)),
            spec("read_page", "A page's title, parent, tags and blocks.", {"page_id": pid}, ("page_id",)),
            spec(
                "create_page",
                "Create a page (optionally under a parent) with text blocks.",
                {"title": S("title", 120), "parent_id": pid, "blocks": A("text blocks", S("block", 1000), 30)},
                ("title",),
            ),
            spec(
                "append_block",
                "Append a text block to a page.",
                {"page_id": pid, "text": S("text", MAX_TEXT)},
                ("page_id", "text"),
            ),
            spec("add_tag", "Tag a page.", {"page_id": pid, "tag": S("tag", 40)}, ("page_id", "tag")),
            spec(
                "move_page",
                "Move a page under a new parent page.",
                {"page_id": pid, "parent_id": pid},
                ("page_id", "parent_id"),
            ),
            spec("list_databases", "Databases with their columns."),
            spec(
                "query_database",
                "Rows of a database, optionally where column == value.",
                {"database_id": db, "column": S("column"), "value": S("value")},
                ("database_id",),
            ),
            spec(
                "update_row",
                "Set one cell of a row.",
                {"database_id": db, "row_id": S("row id, e.g. r4"), "column": S("column"), "value": S("new value")},
                ("database_id", "row_id", "column", "value"),
            ),
            spec(
                "add_row",
                "Add a row; cells maps column -> value.",
                {
                    "database_id": db,
                    "cells": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 200}},
                },
                ("database_id", "cells"),
            ),
        ]

    def _page(self, page_id):
        return get(self.pages, page_id, "page", "Use search_pages to find page ids.")

    def _db(self, database_id):
        return get(self.dbs, database_id, "database", "Use list_databases to see database ids.")

    def _check_cells(self, db: dict, cells: dict) -> None:
        unknown = [c for c in cells if c not in db["columns"]]
        if unknown:
            raise ToolError(f"unknown column {unknown[0]!r}; columns: {', '.join(db['columns'])}")
        if "Status" in cells and db["id"] == "tasks" and cells["Status"] not in STATUSES:
            raise ToolError(f"Status must be one of {', '.join(STATUSES)}")
        if "Due" in cells and not re.fullmatch(r"\d{4}-\d\d-\d\d", cells["Due"]):
            raise ToolError("Due must be a date YYYY-MM-DD")

    def t_search_pages(self, query):
        hits = [p for p in self.pages.values()
                if has(p["title"], query) or query.lower() in p["tags"] or any(has(b, query) for b in p["blocks"])]
        return [{"id": p["id"], "title": p["title"], "tags": p["tags"]} for p in hits[:MAX_LIST]]

    def t_read_page(self, page_id):
        p = self._page(page_id)
        parent = self.pages[p["parent"]]["title"] if p["parent"] else None
        return {**p, "parent": p["parent"] and {"id": p["parent"], "title": parent}}

    def t_create_page(self, title, parent_id=None, blocks=()):
        if parent_id is not None:
            self._page(parent_id)
        return {"page_id": self.page(title, parent_id, (), blocks)}

    def t_append_block(self, page_id, text):
        self._page(page_id)["blocks"].append(text)
        return {"page_id": page_id, "blocks": len(self.pages[page_id]["blocks"])}

    def t_add_tag(self, page_id, tag):
        p = self._page(page_id)
        if tag not in p["tags"]:
            p["tags"].append(tag)
        return {"page_id": page_id, "tags": p["tags"]}

    def t_move_page(self, page_id, parent_id):
        p, _ = self._page(page_id), self._page(parent_id)
        up = parent_id
        while up is not None:
            if up == page_id:
                raise ToolError("cannot move a page under itself or its own sub-page")
            up = self.pages[up]["parent"]
        p["parent"] = parent_id
        return {"page_id": page_id, "parent_id": parent_id}

    def t_list_databases(self):
        return [
            {"id": d["id"], "title": d["title"], "columns": d["columns"], "rows": len(d["rows"])}
            for d in self.dbs.values()
        ]

    def t_query_database(self, database_id, column=None, value=None):
        db = self._db(database_id)
        if column is not None and column not in db["columns"]:
            raise ToolError(f"unknown column {column!r}; columns: {', '.join(db['columns'])}")
        rows = [{"id": r, **cells} for r, cells in db["rows"].items()
                if column is None or value is None or has(cells.get(column, ""), value)]
        return rows[:30]

    def t_update_row(self, database_id, row_id, column, value):
        db = self._db(database_id)
        row = get(db["rows"], row_id, "row", "Use query_database to find row ids.")
        self._check_cells(db, {column: value})
        row[column] = value
        return {"row_id": row_id, **row}

    def t_add_row(self, database_id, cells):
        db = self._db(database_id)
        self._check_cells(db, cells)
        if not cells.get(db["columns"][0]):
            raise ToolError(f"cells must include {db['columns'][0]!r}")
        rid = self.new_id("r")
        db["rows"][rid] = {c: cells.get(c, "") for c in db["columns"]}
        return {"row_id": rid}

    def entities(self):
        out = {f"page:{k}": v for k, v in self.pages.items()}
        for d in self.dbs.values():
            out.update({f"row:{d['id']}:{r}": cells for r, cells in d["rows"].items()})
        return out

    def new_rows(self, db: str, before: set[str]) -> dict[str, dict]:
        return {r: c for r, c in self.dbs[db]["rows"].items() if r not in before}
