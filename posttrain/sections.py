"""Config sections that remember which fields their constructor was given.

A trainer's section default may differ from the section class's own (GRPO's data section has no
``max_length`` and a 512-token prompt limit; ``DataConfig()`` has 1024 and none). YAML and ``key=value``
start from the trainer's section and replace only the keys set (``runtime.config.from_dict``). A section
built in Python, ``GRPOConfig(data=DataConfig(path="sums.jsonl"))``, must keep the trainer's defaults the
same way, so the trainer config needs to know which fields ``DataConfig(...)`` was given: this decorator
records them. It sits below every layer because the sections live in several (data, rollout, runtime).
"""

from __future__ import annotations

import dataclasses
import functools


def remembers_given(cls):
    """Class decorator for a config dataclass: each instance records the names of the fields its
    constructor was given (positionally or by keyword), read by ``given_fields``. ``dataclasses.replace``
    gives every field, so a section derived from another is taken as it is."""
    init = cls.__init__
    names = [f.name for f in dataclasses.fields(cls) if f.init]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.__dict__["_given_fields"] = frozenset(names[: len(args)]) | frozenset(kwargs)

    cls.__init__ = __init__
    return cls


def given_fields(section) -> frozenset[str] | None:
    """The fields the dataclass instance ``section``'s constructor was given; None for an instance of an
    undecorated class."""
    return vars(section).get("_given_fields")
