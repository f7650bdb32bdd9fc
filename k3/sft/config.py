"""SFT configuration: the pre-training `TrainConfig` (optimiser, schedule, checkpoints, telemetry) plus
what fine-tuning adds: the base checkpoint, the conversation data and its mix, rendering options and the
built-in behavioural evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k3.chat.render import THINKING_EFFORTS
from k3.config import ConfigError
from k3.sft.effort import EFFORT_LEVELS
from k3.train.config import Stage, TrainConfig

ON_BAD = ("skip", "error")


@dataclass
class SFTConfig(TrainConfig):
    """`k3 sft` settings. The inherited keys keep their meaning; the SFT defaults differ (one stage of
    `seq_len` tokens per packed row, a few hundred steps at a fine-tuning learning rate).

    Rows: every conversation is rendered to XTML ids + a loss mask (assistant tokens only) and whole
    conversations are packed into rows of `stages[0].seq_len` tokens; one longer than that is cut at the
    row length (its tail is not trained on; counted in the data line).
    """

    base: str | None = None  # official-format checkpoint dir (config.json, safetensors, tokenizer files)
    on_bad: str = "skip"  # a malformed conversation: "skip" (reported by file:line) or "error" (stop)
    thinking_effort: str = "low"  # conversations without their own `thinking_effort` render with this
    # Default data (no --data): oracle trajectories of the practice worlds' train tasks and generated
    # instruction-following items; held-out tasks / items (never trained on) score the evaluation.
    worlds: list[str] = field(default_factory=lambda: ["mail", "chat", "notes", "course", "assistant"])
    world_tasks: int = 38  # train tasks per world (each seen about 3 times by default: repetition beat variety)
    max_difficulty: int = 3  # world tasks of difficulty 1..max_difficulty (train mix and teacher-forced eval)
    instruct_items: int = 250
    # Of the training trajectories, this fraction (evenly spread) declares only the tools it calls plus
    # `lean_distractors` others: the declarations are most of a trajectory's tokens and none of its
    # targets. Held-out trajectories, the validation loss and the episodes keep the world's full list.
    lean_fraction: float = 1.0
    lean_distractors: int = 2
    # Effort-conditioned reasoning (k3.sft.effort): the k-th generated conversation of each kind reasons
    # at efforts[k % len(efforts)] and carries that thinking_effort ([] = one-line reasoning, rendered at
    # `thinking_effort`); an effort listed twice gets twice the conversations. The evaluation measures the
    # mean reasoning length at each distinct one. Low is 3 of 5 by default: the tool-call evaluation (and
    # `k3 eval worlds`) runs at low effort, and low-effort turns (the oracle's one line) are the ones the
    # tiny model learns to act from first (docs/sft.md, the levers).
    efforts: list[str] = field(default_factory=lambda: ["low", "high", "low", "max", "low"])
    # Loss weights (k3.sft.weights): the targets that depend on the context -- each called tool's name,
    # argument values, the first `decision_think_tokens` of each reasoning -- weigh `decision_weight`, the
    # rest 1, normalised to a per-token mean (1.0: the plain mean). One process only: torchrun runs
    # weigh every target 1 (a note says so).
    decision_weight: float = 5.0
    decision_think_tokens: int = 4
    val_conversations: int = 24  # held-out conversations for the validation loss
    # Behavioural evaluation (base model before training, then every `behavior_eval_every` steps
    # (0 = only at the end)): teacher-forced next tool call, instruction following, whole episodes.
    eval_tool_turns: int = 30
    eval_instruct_items: int = 24
    eval_episodes: int = 2  # per world: its easiest held-out task(s)
    eval_max_turns: int = 8
    eval_max_new_tokens: int = 160  # an oracle turn is ~86 tokens (median), ~141 (p90)
    eval_effort_prompts: int = 8  # held-out requests whose reasoning length is measured at each effort
    eval_effort_max_new_tokens: int = 256
    eval_base: bool = True
    behavior_eval_every: int = 0

    def validate(self) -> "SFTConfig":
        super().validate()
        if len(self.stages) != 1:
            raise ConfigError(f"sft config stages={self.stages!r}: SFT packs conversations into one row length; "
                              "give exactly one stage")
        if self.on_bad not in ON_BAD:
            raise ConfigError(f"sft config on_bad={self.on_bad!r}: must be one of {ON_BAD}")
        if self.thinking_effort not in THINKING_EFFORTS:
            raise ConfigError(f"sft config thinking_effort={self.thinking_effort!r}: must be one of {THINKING_EFFORTS}")
        if not isinstance(self.efforts, list) or any(e not in EFFORT_LEVELS for e in self.efforts):
            raise ConfigError(f"sft config efforts={self.efforts!r}: must be a list of {EFFORT_LEVELS}")
        if not isinstance(self.lean_fraction, (int, float)) or not 0 <= self.lean_fraction <= 1:
            raise ConfigError(f"sft config lean_fraction={self.lean_fraction!r}: must be in [0, 1]")
        if isinstance(self.decision_weight, bool) or not isinstance(self.decision_weight, (int, float)) \
                or not self.decision_weight >= 1:
            raise ConfigError(f"sft config decision_weight={self.decision_weight!r}: must be a number >= 1")
        if not isinstance(self.worlds, list) or not all(isinstance(w, str) for w in self.worlds):
            raise ConfigError(f"sft config worlds={self.worlds!r}: must be a list of world names")
        if self.max_difficulty not in (1, 2, 3):
            raise ConfigError(f"sft config max_difficulty={self.max_difficulty!r}: must be 1, 2 or 3")
        for name in ("world_tasks", "instruct_items", "decision_think_tokens", "lean_distractors",
                     "val_conversations", "eval_tool_turns", "eval_instruct_items", "eval_episodes", "eval_max_turns", "eval_max_new_tokens",
                     "eval_effort_prompts", "eval_effort_max_new_tokens", "behavior_eval_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"sft config {name}={v!r}: must be a non-negative int")
        return self

    @property
    def seq_len(self) -> int:
        return self.stages[0].seq_len

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SFTConfig":
        d = SFT_DEFAULTS | dict(d)
        return super().from_dict(d)  # type: ignore[return-value]


# The CPU recipe for k3-tiny (docs/sft.md has the measurements behind it): rows of 2048 tokens, one a step
# (twice the updates of 4096-token rows for the same tokens and time), every training trajectory with lean
# tool declarations (shorter: fewer are cut at the row length), decision tokens weighted 5, a short warmup,
# about three epochs of 38 tasks per world and 250 items (the tiny model learns a world's tools from
# repetition), bf16 compute on the CPU (more steps in the same time).
SFT_DEFAULTS: dict[str, Any] = {
    "max_steps": 600, "tokens_per_step": 2048, "stages": [Stage(2048, 1.0)],
    "lr": 3e-3, "adamw_lr": 3e-3, "warmup_steps": 12, "decay_fraction": 0.3,
    "eval_every": 150, "save_every": 150, "cpu_bf16": True,
}
