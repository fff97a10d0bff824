"""The student: its model, LoRA adapters, device and dtype, the weights samplers need, and the one
hook where parallelism is applied."""

from opd.policy.config import StudentConfig

__all__ = ["Policy", "StudentConfig"]


def __getattr__(name: str) -> object:
    """:class:`Policy` on first use: it imports peft and transformers, which a config check does not
    need."""
    if name == "Policy":
        from opd.policy.policy import Policy

        return Policy
    raise AttributeError(f"module 'opd.policy' has no attribute {name!r}")
