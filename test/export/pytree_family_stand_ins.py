"""Stand-ins for HuggingFace output and cache classes, registered as pytree families.

They behave like the real classes where it matters to pytree and export, so that
``test_export_pytree_family.py`` and a fresh process loading a saved program need
only torch:

* ``ModelOutputLike`` is like transformers' ``ModelOutput``: an ``OrderedDict``
  whose ``@dataclass`` subclasses hold their non-None fields as keys, with items and
  attributes kept in sync.
* ``BaseOutputLike`` is like diffusers' ``BaseOutput``: the same idea, indexable by
  position too, with single-tensor outputs such as ``UNetOutputLike(sample=...)``.
* ``CacheLike`` is like a transformers KV cache: a plain base class whose
  ``@dataclass`` subclasses hold lists of per-layer key and value tensors.
* ``BatchLike`` is like transformers' ``BatchEncoding`` and ``BatchFeature``: a
  ``UserDict`` (a mapping, not a dict) of tensors.

The families are registered when this module is imported, as a library would
register its own classes. ``Seq2SeqLMOutputLike``, ``SlidingWindowCacheLike`` and
``BatchFeatureLike`` are defined after the registration: a family covers future
subclasses too.
"""

import dataclasses
from collections import OrderedDict, UserDict
from typing import Any, ClassVar

import torch
import torch.utils._pytree as pytree


class ModelOutputLike(OrderedDict):
    """The base of the transformers-like outputs (not a dataclass itself)."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(self.values())


@dataclasses.dataclass
class BaseModelOutputLike(ModelOutputLike):
    last_hidden_state: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclasses.dataclass
class CausalLMOutputLike(ModelOutputLike):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: "CacheLike | None" = None


class BaseOutputLike(OrderedDict):
    """The base of the diffusers-like outputs: also indexable by position."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return super().__getitem__(key)
        return tuple(self.values())[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)


@dataclasses.dataclass
class UNetOutputLike(BaseOutputLike):
    sample: torch.Tensor | None = None


@dataclasses.dataclass
class CacheLike:
    """The base of the cache-like classes: a dataclass without fields."""

    def get_seq_length(self) -> int:
        raise NotImplementedError


@dataclasses.dataclass
class DynamicCacheLike(CacheLike):
    """Per-layer key and value tensors of shape (batch, heads, length, head_dim)."""

    keys: list[torch.Tensor] = dataclasses.field(default_factory=list)
    values: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def update(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer == len(self.keys):
            self.keys.append(key)
            self.values.append(value)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], key], dim=-2)
            self.values[layer] = torch.cat([self.values[layer], value], dim=-2)
        return self.keys[layer], self.values[layer]

    def get_seq_length(self) -> int:
        return self.keys[0].shape[-2] if self.keys else 0


class BatchLike(UserDict):
    """The base of the tokenizer- and processor-like outputs."""


pytree.register_pytree_family(ModelOutputLike)
pytree.register_pytree_family(BaseOutputLike)
pytree.register_pytree_family(CacheLike)
pytree.register_pytree_family(BatchLike)


# Defined after their families were registered.


@dataclasses.dataclass
class Seq2SeqLMOutputLike(ModelOutputLike):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: CacheLike | None = None
    encoder_last_hidden_state: torch.Tensor | None = None


@dataclasses.dataclass
class SlidingWindowCacheLike(DynamicCacheLike):
    """Keeps only the last ``window`` positions of each layer."""

    window: ClassVar[int] = 4

    def update(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(layer, key, value)
        self.keys[layer] = keys[..., -self.window :, :]
        self.values[layer] = values[..., -self.window :, :]
        return keys, values


class BatchFeatureLike(BatchLike):
    pass
