"""The K3 pre-training loop: packed documents, progressive context extension, Per-Head Muon,
Quantile Balancing, warmup-stable-decay, periodic validation, atomic checkpoints and exact resume."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch

from k3.config import ConfigError, K3Config, apply_overrides, get_preset
from k3.model.causal_lm import K3ForCausalLM
from k3.model.compile import compile_model
from k3.model.moe import LatentMoE
from k3.ops import to_device_async
from k3.optim import HeadGeometry, PerHeadMuon
from k3.optim.balance_baselines import make_balancer
from k3.quant.qat import QATConfig, apply_qat
from k3.train.config import TrainConfig, lr_factor, stage_at
from k3.train.data import TrainData, prepare_data
from k3.train.flops import BYTES_PER_PARAM, batch_flops, flops_per_token, peak_bf16_flops
from k3.train.host import keep_freed_memory
from k3.train.metrics import MetricsLog, Progress, balance_record, plot_balance, plot_losses, truncate_metrics
from k3.train.state import load_state, rng_state, save_run_config, save_state, set_rng_state, state_path
from k3.train.vision import VisionData, joint_loss, param_groups, prepare_vision_data


def wants_distributed() -> bool:
    """Under torchrun with more than one process (--ep / --cp are no-ops in a single process)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass
class TrainResult:
    out_dir: str
    steps: int
    first_val_loss: float | None
    last_val_loss: float | None
    unigram_entropy: float
    interrupted: bool = False
    vision_eval: dict[str, Any] | None = None  # VisionEvalResult.to_dict() of a vision-language run


CPU_STEP_WARN_FLOPS = 3e13  # ~5 minutes per step at the ~0.1 TFLOP/s of a laptop CPU


class Trainer:
    def __init__(self, cfg: TrainConfig, *, resume: bool = False, ep: int = 1, cp: int = 1) -> None:
        self.cfg = cfg.validate()
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.par = None  # k3.distributed.Parallel under torchrun / --ep / --cp
        if wants_distributed():
            from k3.distributed.runtime import Parallel
            self.par = Parallel(ep, cp, self.device)
            self.device = self.par.device
        if self.device.type == "cpu":
            keep_freed_memory()  # large tensors are reused, not page-faulted in every step (k3.train.host)
        self.main = self.par is None or self.par.is_main
        self.world = 1 if self.par is None else self.par.mesh.world
        self.model_config = self.make_model_config()
        self._check_memory()  # before anything is written or tokenised
        self.out = cfg.out or time.strftime("runs/%Y%m%d-%H%M%S")
        self.ckpt_dir = os.path.join(self.out, "checkpoint")
        if resume:
            state_path(self.ckpt_dir)  # nothing to resume: say so before any work
        self.progress = Progress(cfg.max_steps) if self.main else Progress(cfg.max_steps, open(os.devnull, "w"))
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True)
            if self.device.type == "cpu":
                torch.set_num_threads(1)  # fixed reduction order across runs and machines
        if self.device.type == "cpu":
            torch.set_flush_denormal(True)  # long KDA decays produce denormals that slow CPU math ~5x
        torch.manual_seed(cfg.seed)

        if self.par is not None and not self.main:
            self.par.barrier()  # rank 0 tokenises and fills the cache first
        self.data: TrainData = self.make_data()
        os.makedirs(self.out, exist_ok=True)  # after the data: a bad corpus leaves no empty run behind
        if self.main and not resume:
            save_run_config(self.out, cfg.to_dict() | {"out": self.out})
        if self.par is not None and self.main:
            self.par.barrier()
        self.model = self.make_model().to(self.device)
        if cfg.qat:  # fake quantisers on the routed experts (k3.quant.qat); no new parameters
            apply_qat(self.model, QATConfig.parse(cfg.qat))
        self.num_params = self.model.num_parameters()
        self.peak = peak_bf16_flops(self.device)  # None on CPU / unknown GPUs: no MFU then
        if self.device.type == "cpu":
            self._warn_slow_cpu_steps()
        self.vision: VisionData | None = None
        if self.model.vision is not None:
            if self.par is not None:
                raise ValueError(f"preset {cfg.preset!r}: vision-language training under torchrun is not supported yet")
            if cfg.micro_batch_tokens is not None and cfg.micro_batch_tokens < cfg.tokens_per_step:
                raise ValueError(f"preset {cfg.preset!r}: micro_batch_tokens (gradient accumulation) is not "
                                 "supported with vision-language training yet")
            self.vision = prepare_vision_data(cfg, self.data.tokenizer, self.model.vision.cfg, self.progress.message)
        if self.par is not None:
            self.par.setup(self.model)
        self.model.model.gradient_checkpointing = cfg.activation_checkpointing
        if cfg.compile:  # compiled elementwise regions; matmuls, attention and Triton KDA stay eager
            # text rows have a few fixed shapes (micro-batch, validation): each compiled for its size; the
            # image chats of vision-language training change the token count every step: dynamic shapes
            compile_model(self.model, dynamic=None if self.vision is not None else False)
        geom = HeadGeometry.from_config(self.model_config.text_config)
        groups = param_groups(self.model, geom, cfg)
        self.base_lrs = [g["lr"] for g in groups]
        fused = self.model_config.kernels.muon_fused
        ns = "bfloat16" if cfg.cpu_bf16 else "auto"  # auto: bf16 on CUDA, fp32 on the CPU
        self.opt = (PerHeadMuon(groups, fused=fused, ns_dtype=ns) if self.par is None
                    else self.par.optimizer(groups, fused=fused, ns_dtype=ns))
        self.moe = {i: l.block_sparse_moe for i, l in enumerate(self.model.model.layers)
                    if isinstance(getattr(l, "block_sparse_moe", None), LatentMoE)}
        tc = self.model_config.text_config
        # the router balancer (also counts the loads of "none"); the observer sees training forwards only
        if self.par is not None and cfg.balancing == "quantile_exact":
            raise ConfigError("balancing='quantile_exact' needs every score in one process; use 'quantile' under torchrun")
        self.qb = make_balancer(cfg.balancing if cfg.quantile_balancing else "none", tc.num_hidden_layers,
                                tc.num_experts, tc.num_experts_per_token, bins=cfg.qb_bins, rate=cfg.bias_update_rate)
        for i, moe in self.moe.items():
            moe.gate.score_observer = functools.partial(self.qb.observe, i)
        self.step = 0
        self.stage = -1
        self.val_history: list[float] = []
        if resume:
            self._resume()
        self.log = MetricsLog(os.path.join(self.out, "metrics.jsonl") if self.main else os.devnull, resume=resume)

    # ---- setup (the make_* hooks are what a fine-tuning loop such as k3.sft overrides) -----------
    def make_data(self) -> TrainData:
        """The batch source: `loader` (set_shape / next / state_dict / load_state_dict), validation
        batches and the tokenizer. Pre-training: the packed corpus of `cfg.data`."""
        return prepare_data(self.cfg, self.model_config, self.progress.message)

    def make_model(self) -> K3ForCausalLM:
        """The initial weights (on CPU; the caller moves them). Pre-training: a fresh init from `cfg.seed`."""
        return K3ForCausalLM(self.model_config).init_weights(seed=self.cfg.seed)

    def make_model_config(self) -> K3Config:
        mc = get_preset(self.cfg.preset)
        overrides = dict(self.cfg.model)
        vocab = self.cfg.vocab_size
        if vocab is not None and vocab != mc.text_config.vocab_size:
            overrides["vocab_size"] = vocab
        # k3's tokenizers keep the 256 official special tokens at the last 256 ids, in official order.
        base = overrides.get("vocab_size", mc.text_config.vocab_size) - 256
        overrides.update(bos_token_id=base, eos_token_id=base + 2, pad_token_id=base + 255,
                         media_placeholder_token_id=base + 21)
        hidden = overrides.get("hidden_size", (overrides.get("text_config") or {}).get("hidden_size"))
        if mc.vision_config is not None and hidden is not None and "vision_config" not in overrides:
            # the projector's output width follows the text model's width
            overrides["vision_config"] = dict(mc.vision_config, text_hidden_size=hidden)
        mc = apply_overrides(mc, overrides)
        mc.dtype = "float32" if self.device.type == "cpu" else "bfloat16"
        mc.quantization_config = None  # experts train in full precision; QAT comes later
        return mc.validate()

    def _warn_slow_cpu_steps(self) -> None:
        """A GPU recipe on a CPU (e.g. k3-small's 512K-token steps) runs, but say so up front."""
        tc, seq = self.model_config.text_config, self.cfg.stages[0].seq_len
        step = flops_per_token(tc, self.num_params[1], seq) * self.cfg.tokens_per_step
        if step > CPU_STEP_WARN_FLOPS:
            self.progress.message(
                f"note: each step is {self.cfg.tokens_per_step:,} tokens, ~{step / 1e12:,.0f} TFLOP: on a CPU "
                f"(~0.1 TFLOP/s) that is about {step / 1e11 / 60:,.0f} min per step; preset {self.cfg.preset!r} "
                "is a GPU recipe (k3-tiny is the CPU one)")

    def _check_memory(self) -> None:
        """Refuse, before tokenising anything, a model whose training state cannot fit: ~16 bytes per
        parameter (fp32 weight and gradient, optimizer states, bf16 casts) spread over the ranks, against
        the device's memory (host RAM on a CPU). Activations come on top."""
        with torch.device("meta"):
            total = K3ForCausalLM(self.model_config).num_parameters()[0]
        ranks = self.world
        need = total * BYTES_PER_PARAM / ranks
        if self.device.type == "cuda":
            have = torch.cuda.get_device_properties(self.device).total_memory
        else:
            try:
                have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (AttributeError, ValueError, OSError):  # no sysconf (Windows): nothing to check against
                return
        if need > 0.9 * have:
            raise ConfigError(
                f"preset {self.cfg.preset!r}: {total / 1e9:,.1f}B parameters need about {need / 2**30:,.0f} GiB per "
                f"{'rank' if ranks > 1 else 'device'} for weights, gradients and optimizer state "
                f"({BYTES_PER_PARAM} bytes per parameter over {ranks} rank{'s' if ranks > 1 else ''}); this "
                f"{self.device.type} has {have / 2**30:,.0f} GiB. Use a smaller preset or model overrides, or "
                f"shard it over more GPUs with torchrun (FSDP2, --ep, --cp; docs/distributed.md).")

    def _resume(self) -> None:
        st = load_state(self.ckpt_dir)
        # Through from_dict: keys added to TrainConfig after the checkpoint was written take their defaults.
        saved = type(self.cfg).from_dict(st["train_config"]).to_dict()
        if saved != self.cfg.to_dict() | {"out": saved["out"]}:
            changed = sorted(k for k, v in self.cfg.to_dict().items() if k != "out" and saved.get(k) != v)
            raise ConfigError(f"cannot resume: the training config differs from the checkpoint's in {changed}")
        if isinstance(st["model"], str):  # "dcp": a sharded checkpoint from a distributed run
            from k3.distributed.checkpoint import load_dcp
            load_dcp(os.path.join(self.ckpt_dir, st["model"]), self.model, self.opt,
                     None if self.par is None else self.par.mesh)
        elif self.par is None:
            self.model.load_state_dict(st["model"])
            self.opt.load_state_dict(st["optimizer"])
        else:
            self.par.load_full_model_state(st["model"])
            self.par.load_full_optimizer_state(self.opt, st["optimizer"])
        self.qb.load_state_dict(st["qb"])
        self.data.loader.load_state_dict(st["loader"])
        if self.vision is not None:
            self.vision.loader.load_state_dict(st["vision_loader"])
        set_rng_state(st["rng"])
        self.step, self.stage, self.val_history = st["step"], st["stage"], st["val_history"]
        if self.main:
            truncate_metrics(os.path.join(self.out, "metrics.jsonl"), self.step - 1)
        self.progress.message(f"resumed from {self.ckpt_dir} at step {self.step}")

    def save(self) -> None:
        if self.par is None:
            model, opt = self.model.state_dict(), self.opt.state_dict()
        else:  # sharded torch.distributed.checkpoint, loadable at any world size (also by one process)
            from k3.distributed.checkpoint import save_dcp_atomic
            save_dcp_atomic(os.path.join(self.ckpt_dir, "dcp"), self.model, self.opt, self.par.mesh)
            model = opt = "dcp"
            if not self.main:
                return
        save_state(self.ckpt_dir, {
            "step": self.step, "stage": self.stage, "val_history": self.val_history,
            "train_config": self.cfg.to_dict() | {"out": self.out},
            "model_config": self.model_config.to_dict(),
            "model": model, "optimizer": opt, "qb": self.qb.state_dict(),
            "loader": self.data.loader.state_dict(), "rng": rng_state(),
        } | ({} if self.vision is None else {"vision_loader": self.vision.loader.state_dict()}))

    # ---- loop -----------------------------------------------------------------------------------
    def _autocast(self):
        if self.device.type == "cuda" or self.cfg.cpu_bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _set_stage(self) -> None:
        s = stage_at(self.cfg, self.step)
        if s == self.stage:
            return
        seq = self.cfg.stages[s].seq_len
        B = self.cfg.tokens_per_step // seq
        rows = min(B, max(1, (self.cfg.micro_batch_tokens or self.cfg.tokens_per_step) // seq))
        self.data.loader.set_shape(seq, B)
        self.log.write({"event": "stage", "step": self.step, "stage": s, "seq_len": seq, "batch_size": B,
                        "micro_batch_rows": rows})
        micro = f" in {-(-B // rows)} micro-batches of {rows} rows" if rows < B else ""
        self.progress.message(f"step {self.step}: context stage {s} -> seq_len {seq}, batch {B}{micro}")
        self.stage = s

    def train_step(self) -> dict[str, Any]:
        self._set_stage()
        t0 = time.perf_counter()
        self.model.train()
        batch = next(self.data.loader)
        rows = self.cfg.micro_batch_tokens and max(1, self.cfg.micro_batch_tokens // batch.seq_len)
        micro = batch.split_rows(rows) if rows else [batch]
        # single process: the weights' compute copies are shared by the micro-batches and their
        # gradients accumulate in place (K3ForCausalLM.step_weights); distributed wrappers keep autograd's way
        with self.model.step_weights() if self.par is None else contextlib.nullcontext():
            loss, flops, vb, vision_loss = self._micro_batches(batch, micro)
        if self.par is None:
            gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip or float("inf"))
        else:
            self.par.after_backward()
            gnorm = self.par.clip_grad_norm(self.cfg.grad_clip or float("inf"))
        f = lr_factor(self.cfg, self.step)
        for g, base in zip(self.opt.param_groups, self.base_lrs):
            g["lr"] = base * f
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.moe:
            self.qb.step({i: m.gate.e_score_correction_bias for i, m in self.moe.items()},
                         all_reduce=None if self.par is None else self.par.all_reduce)
        dt = time.perf_counter() - t0
        rec = {"step": self.step, "loss": float(loss), "lr": self.base_lrs[0] * f, "grad_norm": gnorm.item(),
               "tokens": batch.num_tokens, "tok_s": batch.num_tokens / dt, "seq_len": self.cfg.stages[self.stage].seq_len}
        rec.update(balance_record(self.qb.load_balance(), self.qb.load_cv()) if self.moe else {})
        rec["tflops"] = flops / dt / self.world / 1e12  # model FLOPs (text), per GPU
        if self.peak is not None:
            rec["mfu"] = rec["tflops"] * 1e12 / self.peak
        if vision_loss is not None:
            rec["vision_loss"] = vision_loss.item()
            rec["vision_tokens"] = vb.num_tokens
        if self.par is not None:
            rec.update(self.par.metrics())
        return rec

    def _micro_batches(self, batch, micro: list) -> tuple[Any, float, Any, Any]:
        """Forward + backward of each micro-batch, gradients summed in .grad: (loss, model FLOPs, the last
        vision batch, its loss)."""
        vb = vision_loss = None
        loss = 0.0
        flops = 0.0
        for mb in micro:
            if len(micro) > 1 and mb.num_targets == 0:
                continue  # nothing to learn from (its mean loss would be 0/0)
            # each micro-batch's mean loss weighted by its share of the step's targets: the summed
            # gradients equal those of the whole batch in one forward
            w = mb.num_targets / batch.num_targets if len(micro) > 1 else 1.0
            ids, labels = (to_device_async(t, self.device) for t in (mb.input_ids, mb.labels))
            cu = mb.cu_seqlens  # host offsets: the model's layers then never read them back from the GPU
            with self._autocast():
                if self.vision is not None:  # image chats packed after the text rows, one forward
                    vb = next(self.vision.loader).to(self.device)
                    objective, mloss, vision_loss = joint_loss(self.model, ids, labels,
                                                               to_device_async(cu, self.device), vb,
                                                               self.cfg.vision_loss_weight)
                elif self.par is None:
                    objective, mloss = self.text_loss(mb, ids, labels, cu)
                else:
                    local = self.par.local_batch(ids, labels, to_device_async(cu, self.device), mb.seq_len)
                    objective, mloss = self.par.loss(self.model, local)
            (objective * w if len(micro) > 1 else objective).backward()
            loss = loss + mloss.detach() * w
            flops += batch_flops(self.model_config.text_config, self.num_params[1], mb.cu_seqlens)
        return loss, flops, vb, vision_loss

    def text_loss(self, batch, ids: torch.Tensor, labels: torch.Tensor, cu: torch.Tensor) -> tuple[Any, Any]:
        """(objective to backpropagate, mean token loss to log) of one single-process micro-batch: both the
        model's mean cross-entropy. A subclass whose batches carry `loss_weights` overrides it."""
        loss = self.model(ids, labels=labels, cu_seqlens=cu, return_logits=False).loss
        return loss, loss

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total, count = 0.0, 0
        for batch in self.data.val_batches:
            ids, labels = (to_device_async(t, self.device) for t in (batch.input_ids, batch.labels))
            cu = batch.cu_seqlens
            with self._autocast():
                if self.par is None:
                    loss = self.model(ids, labels=labels, cu_seqlens=cu, return_logits=False).loss
                else:
                    local = self.par.local_batch(ids, labels, to_device_async(cu, self.device), batch.seq_len)
                    loss = self.par.loss(self.model, local)[1]
            n = int((labels != -100).sum())
            total += loss.item() * n
            count += n
        return total / max(count, 1)

    def run(self) -> TrainResult:
        cfg = self.cfg
        interrupted = False
        if self.step == 0:
            self.log.write({"event": "start", "step": 0, "unigram_entropy": self.data.unigram_entropy,
                            "params": self.num_params[0], "active_params": self.num_params[1],
                            "train_tokens": self.data.train_tokens, "device": str(self.device)})
            val = self.evaluate()
            self.val_history.append(val)
            self.log.write({"step": 0, "val_loss": val})
            self.progress.message(f"step 0: val_loss {val:.4f} (unigram baseline {self.data.unigram_entropy:.4f})")
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM saves like Ctrl-C
        try:
            while self.step < cfg.max_steps:
                rec = self.train_step()
                self.log.write(rec)
                if not math.isfinite(rec["loss"]):
                    raise FloatingPointError(f"loss became {rec['loss']} at step {self.step}")
                extra = [f"cv {rec['load_cv']:.2f}"] if "load_cv" in rec else []
                extra += [f"mfu {rec['mfu']:.1%}"] if "mfu" in rec else []
                extra += [f"vl {rec['vision_loss']:.3f}"] if "vision_loss" in rec else []
                self.progress.update(self.step, rec["loss"], rec["tok_s"], rec.get("max_load_ratio"), " ".join(extra))
                self.step += 1
                if self.step % cfg.eval_every == 0 or self.step == cfg.max_steps:
                    val = self.evaluate()
                    self.val_history.append(val)
                    self.log.write({"step": self.step, "val_loss": val})
                    self.progress.message(f"step {self.step}: val_loss {val:.4f}")
                    if self.main:
                        plot_losses(self.log.path, os.path.join(self.out, "loss.png"))
                        plot_balance(self.log.path, os.path.join(self.out, "balance.png"))
                if self.step % cfg.save_every == 0 and self.step < cfg.max_steps:
                    self.save()
        except KeyboardInterrupt:
            interrupted = True
            self.progress.message(f"interrupted at step {self.step}: saving {self.ckpt_dir}")
        finally:
            signal.signal(signal.SIGTERM, previous)
        self.save()
        if self.main:
            plot_losses(self.log.path, os.path.join(self.out, "loss.png"))
            plot_balance(self.log.path, os.path.join(self.out, "balance.png"))
        vision_eval = None
        if not interrupted:
            self.export(os.path.join(self.out, "final"))
            vision_eval = self.evaluate_vision()
        self.log.close()
        return TrainResult(self.out, self.step, self.val_history[0] if self.val_history else None,
                           self.val_history[-1] if self.val_history else None, self.data.unigram_entropy, interrupted,
                           vision_eval)

    def evaluate_vision(self) -> dict[str, Any] | None:
        """Held-out multiple-choice accuracy (colour / shape / count) of a vision-language run."""
        if self.vision is None:
            return None
        from k3.train.vision_eval import evaluate_vision

        t0 = time.perf_counter()
        with self._autocast():
            res = evaluate_vision(self.model, self.data.tokenizer, self.vision.heldout)
        self.log.write({"step": self.step, "vision_eval": res.to_dict()})
        self.progress.message(f"step {self.step}: {res.summary()} [{time.perf_counter() - t0:.1f} s]")
        return res.to_dict()

    def export(self, path: str) -> None:
        """The final model in the official checkpoint format, plus the tokenizer files."""
        model = self.model
        if self.par is not None:  # gather on every rank, write from rank 0
            sd = self.par.full_model_state()
            if not self.main:
                return
            model = K3ForCausalLM(self.model_config)
            model.load_state_dict(sd)
            if self.cfg.qat:  # the export packs the experts exactly as the QAT forward quantised them
                apply_qat(model, QATConfig.parse(self.cfg.qat))
        model.save_pretrained(path, dtype="float32" if self.model_config.dtype == "float32" else None)
        self.data.tokenizer.save(path)
        self.progress.message(f"saved {path}")


def train(cfg: TrainConfig, resume: bool = False, ep: int = 1, cp: int = 1) -> TrainResult:
    trainer = Trainer(cfg, resume=resume, ep=ep, cp=cp)
    try:
        return trainer.run()
    finally:
        if trainer.par is not None:
            trainer.par.close()


__all__ = ["Trainer", "TrainResult", "train"]
