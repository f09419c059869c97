"""A transformers modeling file copied into the user's project: profile warns that it does not initialise
as the installed model (transformers 5 treats it as custom code), with the one-line fix."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from opadvisor.profile.vendored import vendored_transformers_words

transformers = pytest.importorskip("transformers")
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def vendored(tmp_path, monkeypatch, request):
    """(name -> the copied module): modeling_bert.py copied into a package of the user's, imports made
    absolute, with or without the footer that declares its classes native again."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from realcode_families import absolute_imports, module_file, native_init_footer

    source = absolute_imports(module_file("transformers.models.bert.modeling_bert").read_text(),
                              "transformers.models.bert")  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))

    def copy(package: str, footer: bool):
        folder = tmp_path / package
        folder.mkdir()
        (folder / "__init__.py").write_text("")
        (folder / "modeling_bert.py").write_text(source + (native_init_footer(source) if footer else ""))
        module = importlib.import_module(f"{package}.modeling_bert")
        request.addfinalizer(
            lambda: [sys.modules.pop(n, None) for n in (package, f"{package}.modeling_bert")]
        )
        return module

    return copy


def test_a_copied_modeling_file_is_named_with_its_fix(vendored):
    copied = vendored("mymodels", footer=False)
    words = vendored_transformers_words(copied.BertForMaskedLM)
    assert words is not None
    assert "BertForMaskedLM comes from a copy of transformers' models/bert/modeling_bert.py" in words
    assert "`BertPreTrainedModel.is_custom_code = classmethod(lambda cls: cls.is_remote_code())`" in words


def test_the_installed_class_and_a_copy_declared_native_are_not(vendored):
    from transformers import BertForMaskedLM

    assert vendored_transformers_words(BertForMaskedLM) is None
    assert vendored_transformers_words(vendored("fixedmodels", footer=True).BertForMaskedLM) is None
    assert vendored_transformers_words(dict) is None  # not a transformers model at all
