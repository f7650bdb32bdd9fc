"""k3: the Kimi K3 system in PyTorch (model, kernels, training recipe, serving)."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["K3ForCausalLM", "K3Config", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import k3` (e.g. for the CLI or the chat renderer) does not pay for the model.
    if name == "K3ForCausalLM":
        from k3.model.causal_lm import K3ForCausalLM

        return K3ForCausalLM
    if name == "K3Config":
        from k3.config import K3Config

        return K3Config
    raise AttributeError(f"module 'k3' has no attribute {name!r}")
