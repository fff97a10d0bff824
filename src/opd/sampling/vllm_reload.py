"""What a weight push into vLLM needs beyond ``reload_weights``: the layers whose weight another
layer owns refreshed, and vLLM's warnings about layers a push never holds kept off the console.
"""

from __future__ import annotations

import logging


def refresh_shared_weight_layers(model) -> None:
    """Re-run the post-load processing of layers whose weight another layer owns (a tied lm head).

    ``reload_weights`` processes the layers it loaded; a head tied to the embedding loads nothing
    of its own, so on a CPU its packed copy of the weight (made when the engine was built) would
    keep the old values: a 0.34-nat log-prob error on a tiny tied model after one update.
    """
    from collections import Counter

    uses = Counter(id(parameter) for _, parameter in model.named_parameters(remove_duplicate=False))
    for module in model.modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        if (
            weight is not None
            and uses[id(weight)] > 1
            and hasattr(method, "process_weights_after_loading")
        ):
            method.process_weights_after_loading(module)


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _unexpected_reload_warning(record: logging.LogRecord) -> bool:
    """False for vLLM's "X: Failed to load weights" about a layer a weight push never holds: a
    rotary embedding (no weights) or a head tied to the embedding (its weight is the embedding's,
    refreshed after by :func:`refresh_shared_weight_layers`). Two such lines a sync would fill a
    run's console, one pair a step."""
    if record.msg != "%s: Failed to load weights" or not record.args:
        return True
    layer = str(record.args[0])
    return not (layer == "ParallelLMHead" or "RotaryEmbedding" in layer)


def quiet_expected_reload_warnings() -> None:
    """Keep vLLM's expected reload warnings off the console (once per process); any other
    layer's failure to load still shows."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if _unexpected_reload_warning not in logger.filters:
        logger.addFilter(_unexpected_reload_warning)
