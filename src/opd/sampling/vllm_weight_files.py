"""vLLM weight-transfer backend ``opd_safetensors``: a rollout server loads the student's weights
from safetensors files the trainer wrote, through vLLM's own weight-update routes.

vLLM's servers take new weights through pluggable transfer engines (``--weight-transfer-config
'{"backend": ...}'`` and the routes ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``). Its built-in backends need NCCL or CUDA IPC; this one needs only a
file system both sides see (``/dev/shm`` on one machine, a shared disk across machines), so the
same trainer code runs on CPUs and is a fallback on GPUs. opd registers it with vLLM as a general
plugin (the ``vllm.general_plugins`` entry point), so any vLLM server started in an environment
where opd is installed has it.

It loads files only from the directory fixed when the server started (``opd rollout-server
--weights-dir``, :func:`opd.sampling.rollout_guard.weights_root`): a request naming any other
file is refused before anything is read, and logged.

Each update loads layer by layer through vLLM's layerwise reload (every layer's post-load
processing re-run, as ``reload_weights`` does), then re-processes layers whose weight another
layer owns (a tied lm head), which a reload leaves stale on a CPU. A failed update leaves a mix
of old and new weights; the trainer tags the server ``-loading`` before it starts, so no rollout
accepts them, and the next update replaces them all.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

from safetensors import safe_open
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from opd.sampling.rollout_guard import WEIGHTS_DIR_ENV, files_outside, weights_root
from opd.sampling.vllm_reload import quiet_expected_reload_warnings, refresh_shared_weight_layers

logger = logging.getLogger("vllm.opd_safetensors")  # vLLM's handler prints it in the server's log

BACKEND = "opd_safetensors"
"""The name servers are started with: ``--weight-transfer-config '{"backend":
"opd_safetensors"}'``."""


@dataclass
class FilesInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the files are the channel."""


@dataclass
class FilesUpdateInfo(WeightTransferUpdateInfo):
    """One chunk of an update: safetensors files holding Hugging Face-named weights."""

    files: list[str] = field(default_factory=list)


class SafetensorsWeightTransferEngine(WeightTransferEngine[FilesInitInfo, FilesUpdateInfo]):
    """Loads the weights named in each ``/update_weights`` chunk from the files it lists."""

    init_info_cls = FilesInitInfo
    update_info_cls = FilesUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: FilesInitInfo) -> None:
        """No rendezvous: the trainer only needs the server to read its files."""

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        """Load one chunk (loading from host memory needs no device synchronisation). A chunk that
        fails (a file cut short) ends the reload before the error reaches the trainer: vLLM then
        closes the update, and layers left waiting for weights (on the meta device) would break
        every later update and rollout."""
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self.finish_weight_update()
            raise

    def receive_weights(self, update_info: FilesUpdateInfo) -> None:
        root = weights_root()
        if not isinstance(update_info.files, list):
            raise ValueError(
                f"refused: 'files' must be a list of paths, got {type(update_info.files).__name__}"
            )
        if refused := files_outside(update_info.files, root):
            logger.warning(
                "refused a weight update naming %d file(s) outside %s: %s",
                len(refused),
                root,
                [str(path)[:200] for path in refused[:3]],
            )
            raise ValueError(
                f"refused: {str(refused[0])[:200]!r} is not under this server's weights directory "
                f"{root} (fixed at start: opd rollout-server --weights-dir, or {WEIGHTS_DIR_ENV}); "
                "the trainer's student.rollout_weights_dir must be that directory or one inside it"
            )
        for path in update_info.files:
            with safe_open(path, framework="pt") as weights:
                self.model.load_weights(
                    [(name, weights.get_tensor(name)) for name in weights.keys()]  # noqa: SIM118
                )

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        quiet_expected_reload_warnings()
        finalize_layerwise_reload(self.model, self.model_config)
        refresh_shared_weight_layers(self.model)

    def shutdown(self) -> None:
        """Nothing held between updates."""


def register() -> None:
    """The ``vllm.general_plugins`` entry point: makes the backend known to vLLM in every
    process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # registered already (the plugin loads once a process)
        WeightTransferEngineFactory.register_engine(
            BACKEND, __name__, "SafetensorsWeightTransferEngine"
        )
