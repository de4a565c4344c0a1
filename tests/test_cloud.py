"""Cloud jobs: `--data-url` / `--train-url` with and without the `moxing` library.

moxing is ModelArts' object-storage library; it cannot be installed here, so the tests that
need it use `FakeMoxing`, a stand-in for its `mox.file.copy_parallel`.
"""

import json
import os
import shutil
import types

import mindspore as ms
import pytest
import yaml

import model_zoo.train.cloud as cloud
from model_zoo.cli import build_parser, main
from model_zoo.config import load_config
from model_zoo.train.cloud import CloudStorage

from conftest import run_cli, write_tiny_config


class FakeMoxing:
    """Stands in for the cloud library's copy function, `moxing.file.copy_parallel(src, dst)`.

    The real one copies a directory tree between object storage (`obs://bucket/...`) and the
    local disk. Here an `obs://` location is a folder under `obs_root`, and the copy is
    `shutil.copytree(..., dirs_exist_ok=True)` (like the real one, it adds and overwrites
    files but never deletes any). Every call is recorded as (src, dst, files copied).
    """

    def __init__(self, obs_root):
        self.obs_root = str(obs_root)
        self.calls = []
        self.file = types.SimpleNamespace(copy_parallel=self.copy_parallel)

    def local(self, location: str) -> str:
        if location.startswith("obs://"):
            return os.path.join(self.obs_root, location[len("obs://"):])
        return location

    def copy_parallel(self, src, dst):
        source = self.local(src)
        self.calls.append((src, dst, files_under(source)))
        shutil.copytree(source, self.local(dst), dirs_exist_ok=True)


def files_under(directory) -> list:
    """Relative paths of the files under `directory`, sorted."""
    return sorted(os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/")
                  for root, _, names in os.walk(directory) for name in names)


def write_file(path, text="x"):
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def saved_dataset_dir(run_dir) -> str:
    """data.dataset_dir of the resolved config a run saved."""
    with open(os.path.join(str(run_dir), "config.yaml"), encoding="utf-8") as handle:
        return yaml.safe_load(handle)["data"]["dataset_dir"]


@pytest.fixture
def config(tmp_path):
    """A tiny config whose data.dataset_dir is a folder that should never be used."""
    return load_config(write_tiny_config(tmp_path / "tiny.yaml", tmp_path / "configured-data"))


@pytest.fixture
def no_moxing(monkeypatch):
    monkeypatch.setattr(cloud, "import_moxing", lambda: None)


@pytest.fixture
def moxing(monkeypatch, tmp_path):
    fake = FakeMoxing(tmp_path / "obs")
    monkeypatch.setattr(cloud, "import_moxing", lambda: fake)
    return fake


def test_moxing_is_not_installed_here():
    assert cloud.import_moxing() is None


def test_both_spellings_of_the_cloud_flags_parse():
    args = build_parser().parse_args(["train", "c.yaml", "--data_url=obs://b/data",
                                      "--train-url", "obs://b/out"])
    assert (args.data_url, args.train_url) == ("obs://b/data", "obs://b/out")


# --- without moxing: plain paths used in place ---------------------------------------------

def test_without_moxing_the_urls_are_paths_used_in_place(no_moxing, config, tmp_path):
    data, out, cache = tmp_path / "data", tmp_path / "out", tmp_path / "cache"
    storage = CloudStorage(str(data), str(out), cache_dir=str(cache))
    assert not storage.copies
    assert storage.prepare(config, "outputs/ignored", resume=False) == str(out)
    assert config.data.dataset_dir == str(data)
    write_file(out / "rank_1" / "metrics.jsonl")
    storage.upload(str(out / "rank_1"))
    storage.upload(str(out))
    assert not cache.exists()
    assert files_under(out) == ["rank_1/metrics.jsonl"]


def test_without_urls_nothing_changes(no_moxing, config, tmp_path):
    configured = config.data.dataset_dir
    storage = CloudStorage(cache_dir=str(tmp_path / "cache"))
    assert storage.prepare(config, "outputs/run", resume=True) == "outputs/run"
    assert config.data.dataset_dir == configured
    storage.upload("outputs/run")
    assert not (tmp_path / "cache").exists()


def test_data_url_alone_keeps_the_output_dir(no_moxing, config, tmp_path):
    storage = CloudStorage(data_url=str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"))
    assert storage.prepare(config, "outputs/run", resume=False) == "outputs/run"
    assert config.data.dataset_dir == str(tmp_path / "data")


# --- with moxing: copies through a local cache ---------------------------------------------

def test_data_is_copied_to_the_cache_and_the_config_points_there(moxing, config, tmp_path):
    write_file(tmp_path / "obs" / "bucket" / "data" / "train.mindrecord", "records")
    cache = tmp_path / "cache"
    storage = CloudStorage("obs://bucket/data/", "obs://bucket/out/", cache_dir=str(cache))
    assert storage.copies
    local_output = storage.prepare(config, "outputs/ignored", resume=False)
    assert local_output == str(cache / "output")
    assert config.data.dataset_dir == str(cache / "data")
    assert (cache / "data" / "train.mindrecord").read_text() == "records"
    # without --resume, train_url is not read
    assert [(src, dst) for src, dst, _ in moxing.calls] == [("obs://bucket/data/",
                                                              str(cache / "data"))]


def test_resume_copies_train_url_to_the_cache_first(moxing, config, tmp_path):
    remote = tmp_path / "obs" / "bucket" / "out"
    write_file(remote / "checkpoints" / "step_00000002.ckpt")
    write_file(remote / "rank_1" / "checkpoints" / "step_00000002.ckpt")
    cache = tmp_path / "cache"
    storage = CloudStorage(None, "obs://bucket/out", cache_dir=str(cache))
    assert storage.prepare(config, "outputs/ignored", resume=True) == str(cache / "output")
    assert moxing.calls[0][:2] == ("obs://bucket/out", str(cache / "output"))
    assert files_under(cache / "output") == ["checkpoints/step_00000002.ckpt",
                                             "rank_1/checkpoints/step_00000002.ckpt"]
    # no data_url: the configured dataset is used
    assert config.data.dataset_dir == str(tmp_path / "configured-data")


def test_upload_of_a_rank_folder_lands_in_the_same_folder_under_train_url(moxing, config,
                                                                           tmp_path):
    cache = tmp_path / "cache"
    storage = CloudStorage(None, "obs://bucket/out/", cache_dir=str(cache))
    local_output = storage.prepare(config, "outputs/ignored", resume=False)
    write_file(os.path.join(local_output, "rank_1", "metrics.jsonl"), "{}")
    storage.upload(os.path.join(local_output, "rank_1"))
    assert moxing.calls[-1][:2] == (os.path.join(local_output, "rank_1"),
                                    "obs://bucket/out/rank_1")
    assert files_under(tmp_path / "obs" / "bucket" / "out") == ["rank_1/metrics.jsonl"]


def test_upload_of_the_top_folder_lands_in_train_url(moxing, config, tmp_path):
    cache = tmp_path / "cache"
    storage = CloudStorage(None, "obs://bucket/out/", cache_dir=str(cache))
    local_output = storage.prepare(config, "outputs/ignored", resume=False)
    write_file(os.path.join(local_output, "checkpoints", "step_00000002.ckpt"))
    storage.upload(local_output)
    assert moxing.calls[-1][:2] == (local_output, "obs://bucket/out")
    assert files_under(tmp_path / "obs" / "bucket" / "out") == ["checkpoints/step_00000002.ckpt"]


def test_upload_without_train_url_does_nothing(moxing, config, tmp_path):
    write_file(tmp_path / "obs" / "bucket" / "data" / "train.mindrecord")
    storage = CloudStorage("obs://bucket/data", None, cache_dir=str(tmp_path / "cache"))
    assert storage.prepare(config, "outputs/run", resume=False) == "outputs/run"
    storage.upload("outputs/run")
    assert len(moxing.calls) == 1  # the data copy only


# --- whole runs through the command line ---------------------------------------------------

def test_cli_with_plain_paths_trains_into_train_url(write_config, tiny_dataset, tmp_path):
    """The cloud entry point where moxing is absent: both flags are plain paths."""
    unused = tmp_path / "configured-data"
    config = write_config({"data.dataset_dir": str(unused)})
    out = tmp_path / "train_url"
    result = run_cli("train", config, "--data_url", tiny_dataset, "--train_url", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000002.ckpt",
                                                       "step_00000004.ckpt"]
    assert (out / "metrics.jsonl").is_file() and (out / "loss_curve.png").is_file()
    assert saved_dataset_dir(out) == tiny_dataset
    assert not unused.exists()  # the dataset came from --data_url, nothing was built


@pytest.fixture
def graph_mode():
    """The trainer sets GRAPH mode process-wide; restore the mode for other test files."""
    previous = ms.get_context("mode")
    yield
    ms.set_context(mode=previous)


@pytest.mark.slow
def test_cloud_job_uploads_after_each_checkpoint_and_resumes_on_a_new_machine(
        graph_mode, moxing, monkeypatch, write_config, tiny_dataset, tmp_path):
    """A ModelArts-style run in this process: data from obs://, outputs back to obs:// after
    every checkpoint and at the end; then a resumed job with an empty cache continues it."""
    shutil.copytree(tiny_dataset, tmp_path / "obs" / "bucket" / "data")
    unused = tmp_path / "configured-data"
    config = write_config({"data.dataset_dir": str(unused), "train.steps": 4,
                           "train.save_steps": 2})
    caches = iter([tmp_path / "machine1", tmp_path / "machine2"])

    class LocalCacheStorage(CloudStorage):
        def __init__(self, data_url=None, train_url=None):
            super().__init__(data_url, train_url, cache_dir=str(next(caches)))

    monkeypatch.setattr(cloud, "CloudStorage", LocalCacheStorage)
    urls = ["--data_url=obs://bucket/data", "--train_url=obs://bucket/out"]
    assert main(["train", config, *urls]) == 0

    cache = tmp_path / "machine1"
    copies = [(src, dst) for src, dst, _ in moxing.calls]
    assert copies == [("obs://bucket/data", str(cache / "data"))] + \
        [(str(cache / "output"), "obs://bucket/out")] * 3  # step 2, step 4, the end
    uploaded_checkpoints = [[f for f in files if f.startswith("checkpoints/")]
                            for _, _, files in moxing.calls[1:]]
    assert uploaded_checkpoints[0] == ["checkpoints/step_00000002.ckpt"]
    assert "loss_curve.png" in moxing.calls[-1][2]
    remote = tmp_path / "obs" / "bucket" / "out"
    assert saved_dataset_dir(remote) == str(cache / "data")
    assert not unused.exists()

    # A new job (empty cache) resumes from what is in obs://bucket/out.
    moxing.calls.clear()
    assert main(["train", config, *urls, "--resume", "--set", "train.steps=6"]) == 0
    cache = tmp_path / "machine2"
    assert [(src, dst) for src, dst, _ in moxing.calls[:2]] == [
        ("obs://bucket/data", str(cache / "data")), ("obs://bucket/out", str(cache / "output"))]
    steps = [json.loads(line)["step"]
             for line in (remote / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert (remote / "checkpoints" / "step_00000006.ckpt").is_file()
