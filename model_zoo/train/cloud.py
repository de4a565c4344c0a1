"""Cloud jobs: data and output locations passed as `--data-url` / `--train-url`.

Ascend cloud jobs (ModelArts) start the entry point with `--data_url` and `--train_url`,
object-storage locations such as `obs://bucket/data/`. When the `moxing` library is
importable (it is on those machines), the data is copied to a local cache before training
and the outputs are copied back after every checkpoint and at the end, so a stopped job
loses at most the steps since its last checkpoint. Without moxing the two locations are
plain paths used in place.
"""

import os

from model_zoo.config import Config

CACHE_DIR = "/cache"


def import_moxing():
    """The moxing module of a cloud machine, or None."""
    try:
        import moxing
    except ImportError:
        return None
    return moxing


class CloudStorage:
    """Moves a job's data in and its outputs out.

    Args:
        data_url: where the dataset directory is (a path, or a URL moxing reads), or None.
        train_url: where outputs go (a path, or a URL moxing writes), or None.
        cache_dir: local directory for copies when moxing is used.
    """

    def __init__(self, data_url: str = None, train_url: str = None, cache_dir: str = CACHE_DIR):
        self.data_url = data_url
        self.train_url = train_url
        self.cache_dir = cache_dir
        self.moxing = import_moxing()
        self.local_output = None

    @property
    def copies(self) -> bool:
        return self.moxing is not None

    def _copy(self, source: str, target: str):
        self.moxing.file.copy_parallel(source, target)

    def prepare(self, config: Config, output_dir: str, resume: bool) -> str:
        """Point the config at the local data, fetch earlier outputs when resuming, and
        return the local output directory to train into."""
        if self.data_url:
            if self.copies:
                local_data = os.path.join(self.cache_dir, "data")
                print(f"copying {self.data_url} to {local_data}", flush=True)
                self._copy(self.data_url, local_data)
                config.data.dataset_dir = local_data
            else:
                config.data.dataset_dir = self.data_url
        if not self.train_url:
            return output_dir
        if not self.copies:
            return self.train_url
        self.local_output = os.path.join(self.cache_dir, "output")
        if resume:
            print(f"copying {self.train_url} to {self.local_output} to resume", flush=True)
            self._copy(self.train_url, self.local_output)
        return self.local_output

    def upload(self, output_dir: str):
        """Copy a run's local outputs (a rank's folder included) to the same place under
        train_url; nothing to do for plain paths."""
        if not (self.train_url and self.copies):
            return
        relative = os.path.relpath(output_dir, self.local_output)
        target = self.train_url.rstrip("/")
        if relative != ".":
            target += "/" + relative.replace(os.sep, "/")
        self._copy(output_dir, target)
