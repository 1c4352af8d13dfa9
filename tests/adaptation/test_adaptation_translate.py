"""Translation: loading, shape/dtype/range, the picklable Translator, the CLI."""

from __future__ import annotations

import json
import pickle

import cv2
import numpy as np
import pytest
import torch

from adaptation.train import compose_config, train
from adaptation.translate import GeneratorError, Translator, load_generator, main, translate


@pytest.fixture(scope="module")
def trained(tmp_path_factory, _adapt_data):
    return tmp_path_factory.mktemp("translate")


@pytest.fixture
def gen_dir(adapt_dirs, trained):
    out = trained / "run"
    if not (out / "generator.pt").is_file():
        sim, real = adapt_dirs
        train(compose_config([
            f"sim_dir={sim}", f"real_dir={real}", f"output_dir={out}", "trainer=cpu", "logger=none",
            "trainer.enable_progress_bar=false", "max_steps=2", "val_every_n_steps=2",
            "metrics.probe.steps=2", "metrics.swd.directions=16", "metrics.swd.repeats=1",
        ]))
    return out


def _frames(n=None, size=(96, 96)):
    rng = np.random.default_rng(0)
    shape = (size[1], size[0], 3) if n is None else (n, size[1], size[0], 3)
    return rng.integers(0, 256, shape, dtype=np.uint8)


@pytest.mark.parametrize("source", ["dir", "pt", "last.ckpt", "best.ckpt"])
def test_load_generator_from_every_source(gen_dir, source):
    path = {"dir": gen_dir, "pt": gen_dir / "generator.pt"}.get(source, gen_dir / "checkpoints" / source)
    g = load_generator(path)
    assert g.meta["image_size"] == [96, 96] and not g.training
    assert torch.load(gen_dir / "generator.pt", weights_only=True)  # a plain state_dict


@pytest.mark.parametrize("n,size", [(None, (96, 96)), (3, (96, 96)), (2, (160, 120))])
def test_translate_keeps_shape_dtype_and_range(gen_dir, n, size):
    g = load_generator(gen_dir)
    x = _frames(n, size)
    y = translate(x, g, "cpu")
    assert y.shape == x.shape and y.dtype == np.uint8
    assert y.min() >= 0 and y.max() <= 255 and y.std() > 10


def test_translate_rejects_non_rgb8(gen_dir):
    g = load_generator(gen_dir)
    with pytest.raises(ValueError, match="uint8"):
        translate(np.zeros((96, 96, 3), np.float32), g)
    with pytest.raises(ValueError, match=r"\(H, W, 3\)"):
        translate(np.zeros((96, 96), np.uint8), g)


def test_translator_pickles_into_workers_and_starts_from_raw(gen_dir):
    from perception.core.calibration import Calibration, default_calibration_path

    tr = pickle.loads(pickle.dumps(Translator(gen_dir)))
    assert tr._net is None
    x = _frames()
    assert tr(x).shape == x.shape
    assert Translator(gen_dir, p=0.0)(x) is x or np.array_equal(Translator(gen_dir, p=0.0)(x), x)
    calib = Calibration.load(default_calibration_path())
    raw = np.full((calib.height, calib.width, 3), 128, np.uint8)
    assert tr.from_raw(raw, calib).shape == (96, 96, 3)


def test_translator_in_a_dataloader_worker(gen_dir):
    class DS(torch.utils.data.Dataset):
        def __init__(self, tr):
            self.tr = tr

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return torch.from_numpy(self.tr(_frames()))

    dl = torch.utils.data.DataLoader(DS(Translator(gen_dir)), batch_size=2, num_workers=1)
    batch = next(iter(dl))
    assert batch.shape == (2, 96, 96, 3) and batch.dtype == torch.uint8


def test_missing_generator_is_named(tmp_path):
    with pytest.raises(GeneratorError, match="does not exist"):
        load_generator(tmp_path)


def test_cli_writes_adapted_frames(gen_dir, adapt_dirs, tmp_path):
    _, real = adapt_dirs
    out = tmp_path / "adapted"
    main([f"generator={gen_dir}", f"input={real}", f"output_dir={out}"])
    files = sorted(out.glob("adapted_*.png"))
    assert files and cv2.imread(str(files[0])).shape == (96, 96, 3)
    assert json.loads((out / "translate.json").read_text())["frames"] == len(files)


def test_translator_leaves_the_callers_threads_alone(gen_dir):
    """A policy trainer translating its frames keeps all its threads (a translator that
    set one thread process-wide slowed the adapted policy's training 1.6x); asked to, it sets them."""
    torch.set_num_threads(2)
    Translator(gen_dir)(_frames())
    assert torch.get_num_threads() == 2
    Translator(gen_dir, num_threads=1)(_frames())
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("args, key", [([], "generator"), (["batch_size=abc"], "batch_size"),
                                       (["raw=maybe"], "raw")])
def test_cli_bad_arguments_name_their_key(gen_dir, adapt_dirs, tmp_path, capsys, args, key):
    _, real = adapt_dirs
    base = [f"generator={gen_dir}", f"input={real}", f"output_dir={tmp_path / 'out'}"]
    base = [a for a in base if not a.startswith(key + "=")]
    with pytest.raises(SystemExit) as exc:
        main(base + args)
    assert exc.value.code == 2 and key in capsys.readouterr().err
    assert not (tmp_path / "out" / "translate.json").exists()
