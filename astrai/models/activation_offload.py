"""`model.gradient_checkpointing: offload`: the activations a checkpointed model keeps for backward, in host memory.

With gradient checkpointing a decoder keeps, for backward, little more than each layer's input [tokens, hidden]
(the rest is recomputed layer by layer): at long context those inputs, layers x tokens x hidden, are most of what
the activations still take (ALST's "activation checkpoint offload"). torch's `save_on_cpu` stores every tensor
autograd saves during the forward in host memory (pinned on a GPU, so the copies overlap) and brings it back
when backward needs it; wrapped around the model's whole forward, with checkpointing on, those are the layers'
inputs and the few tensors outside the layers. Recomputed forwards inside backward save on the device as usual.
On a CPU there is no other memory to move to; the copies change nothing but time (the suite runs it there to
check the numbers stay the same).
"""

from __future__ import annotations

import torch


def offload_saved_activations(model: torch.nn.Module) -> None:
    """Keep what `model`'s forward saves for backward in host memory, for every forward with gradient enabled."""
    pin = torch.cuda.is_available()

    def enter(module, args, kwargs):
        if torch.is_grad_enabled():
            context = torch.autograd.graph.save_on_cpu(pin_memory=pin)
            context.__enter__()
            module._astrai_offload = context

    def leave(module, args, kwargs, output):
        context = getattr(module, "_astrai_offload", None)
        if context is not None:
            module._astrai_offload = None
            context.__exit__(None, None, None)

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)
