"""DirectCall: a module whose call goes straight to its forward, without nn.Module.__call__.

nn.Module.__call__ runs Python of its own before each forward (hook and tracing checks), and a
decoder layer makes a dozen such calls per step. Right after a decode step's weights have
streamed through the caches, that Python runs from memory and costs several times its warm
cost (docs/benchmarks/vs_llama_cpp.md, "A decode step's Python from cold caches"). Our models
register no hooks, so their modules skip it. Hooks registered on these modules would not run:
register_forward_hook and register_forward_pre_hook refuse them.
"""

from __future__ import annotations

from typing import Any, NoReturn


class DirectCall:
    """Put first in the bases of an nn.Module subclass: `class RMSNorm(DirectCall, nn.Module)`."""

    forward: Any  # the module's own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"{type(self).__name__} calls forward directly: hooks would not run")

    def register_forward_pre_hook(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"{type(self).__name__} calls forward directly: hooks would not run")
