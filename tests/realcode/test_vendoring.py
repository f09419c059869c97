"""The harness's vendoring of several modules of one package (a timm model file plus the timm.layers modules
it builds on): the copies' imports of each other's originals, direct or through a re-exporting package, point
at the copies, so the model runs the copied layers and the findings about them land in the user's src/."""

from __future__ import annotations

from pathlib import Path

from realcode_families import point_imports_at_copies


def test_imports_of_vendored_layers_point_at_the_copies(tmp_path: Path) -> None:
    model = tmp_path / "vit.py"
    model.write_text(
        "from zoo.layers import (\n    Attention,\n    DropPath as DP,\n    Mlp,\n)\n"
        "from zoo.layers.mlp import Mlp as M2\nfrom zoo.data import MEAN\n"
    )
    attention = tmp_path / "attention.py"
    attention.write_text("from zoo.layers.config import use_fused\n\n\nclass Attention:\n    pass\n")
    mlp = tmp_path / "mlp.py"
    mlp.write_text("class Mlp:\n    pass\n\n\ndef helper():\n    pass\n")
    point_imports_at_copies(
        ("zoo.models.vit", "zoo.layers.attention", "zoo.layers.mlp"), [model, attention, mlp], "mine"
    )
    assert model.read_text() == (
        "from zoo.layers import DropPath as DP\n"
        "from mine.attention import Attention\n"
        "from mine.mlp import Mlp\n"
        "from mine.mlp import Mlp as M2\n"
        "from zoo.data import MEAN\n"
    )
    # a name the copies do not define stays with the installed package
    assert attention.read_text().startswith("from zoo.layers.config import use_fused\n")


def test_one_module_is_left_as_copied(tmp_path: Path) -> None:
    model = tmp_path / "vit.py"
    source = "from zoo.layers import Attention\n"
    model.write_text(source)
    point_imports_at_copies(("zoo.models.vit",), [model], "mine")
    assert model.read_text() == source
