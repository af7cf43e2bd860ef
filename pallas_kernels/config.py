"""The ops' one calling convention: `op(..., implementation=<name>, config=<that implementation's
config> | None)`. Each op module names its implementations ("xla": its jnp reference; "triton",
"mosaic": Pallas kernels) and maps each to a frozen config dataclass (`CONFIGS`); a config's
fields are tuning overrides, None meaning the kernel's own choice."""

from __future__ import annotations

import dataclasses
from typing import ClassVar


class TuningConfig:
    """Base of the ops' frozen config dataclasses: on construction, ValueError naming the field
    unless every field is None or a positive int (>= 0 for the fields named in ZERO_OK; bools
    excluded): what every tuning knob of the kernels is (a tile size, a count)."""

    ZERO_OK: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            minimum = 0 if field.name in self.ZERO_OK else 1
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
                raise ValueError(f"{type(self).__name__}.{field.name} must be None or an int >= {minimum}, "
                                 f"got {value!r}")


def check_implementation(op: str, implementation, config, configs: dict) -> None:
    """ValueError naming the argument unless `implementation` is one of `configs` (the op's names)
    and `config` is None or an instance of that implementation's config class."""
    if not isinstance(implementation, str) or implementation not in configs:
        raise ValueError(f"{op}: implementation must be one of {tuple(configs)}, got {implementation!r}")
    cls = configs[implementation]
    if config is not None and (cls is None or not isinstance(config, cls)):
        want = "None (it takes no config)" if cls is None else f"a {cls.__name__} or None"
        raise ValueError(f"{op}: config for implementation {implementation!r} must be {want}, "
                         f"got {type(config).__name__}")


def overrides(config) -> dict:
    """The fields of `config` that are set (not None), as keyword arguments; {} for None."""
    if config is None:
        return {}
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if getattr(config, f.name) is not None}
