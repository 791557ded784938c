"""Shipped model configs without weights (config.json of each, named by shape), for
`load_format="dummy"` and `tandem model dummy`; tandem.models.fetch.shape_dir makes a model
directory of one."""

from pathlib import Path

SHAPES_DIR = Path(__file__).parent
SHAPES = tuple(sorted(p.stem for p in SHAPES_DIR.glob("*.json")))
