"""How a Hugging Face model is recognised and described, on plain torch modules."""

from __future__ import annotations

import torch

from fsdp_nb.models.rank_hugging_face import (
    hf_init_weights,
    hugging_face_meta,
    is_hugging_face,
    tied_parameters,
)
from fsdp_nb.models.wire_wrap_options import ClassNames, make_options, no_split_default


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)


class Special(Block):
    pass


class Tied(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.blocks = torch.nn.ModuleList([Block(), Special()])
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight

    @classmethod
    def from_config(cls) -> Tied:
        return cls()


def test_a_declared_no_split_list_becomes_the_default_auto_wrap():
    for spec in (Tied, Tied(), Tied.from_config):
        assert no_split_default(spec) == ClassNames(("Block",))
    assert no_split_default(Block) is None and no_split_default("model") is None
    pick = ClassNames(("Block",))
    assert [n for n, m in Tied().named_modules() if pick(m)] == ["blocks.0", "blocks.1"]  # subclasses too
    assert make_options(auto_wrap=pick).auto_wrap is pick


def test_tied_parameters_name_the_copy_and_its_source():
    assert tied_parameters(Tied()) == {"head.weight": "embed.weight"}
    assert tied_parameters(Block()) == {}


def test_only_a_transformers_model_is_taken_for_one():
    assert not is_hugging_face(Tied()) and hugging_face_meta(Tied()) == {}


def test_hugging_face_init_weights_is_called_on_a_module():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []
            self.lin = torch.nn.Linear(1, 1)

        def _init_weights(self, module):
            self.seen.append(type(module).__name__)

    m = Model()
    hf_init_weights(m, m.lin)
    assert m.seen == ["Linear"]
