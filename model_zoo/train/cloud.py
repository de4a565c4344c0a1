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
from model_zoo.errors import UserInputError
from model_zoo.files import exclusive_lock, write_atomically

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

    def _copy_once(self, source: str, target: str, why: str):
        """Copy to a local folder once per machine: the ranks of a server share the cache,
        so the first copies while the others wait, then all read the finished copy."""
        marker = target.rstrip("/") + ".copied"
        with exclusive_lock(target.rstrip("/") + ".lock"):
            if not os.path.exists(marker):
                print(f"copying {source} to {target} {why}", flush=True)
                self._copy(source, target)
                write_atomically(marker, source + "\n")

    def prepare(self, config: Config, output_dir: str, resume: bool) -> str:
        """Point the config at the local data, fetch earlier outputs when resuming, and
        return the local output directory to train into."""
        for flag, url in (("--data-url", self.data_url), ("--train-url", self.train_url)):
            if url and "://" in url and not self.copies:
                raise UserInputError(f"{flag} {url}: a URL needs the moxing library of the "
                                     f"cloud platform, which is not installed here; give a path")
        if self.data_url:
            if self.copies:
                local_data = os.path.join(self.cache_dir, "data")
                self._copy_once(self.data_url, local_data, "(the dataset)")
                config.data.dataset_dir = local_data
            else:
                config.data.dataset_dir = self.data_url
        if not self.train_url:
            return output_dir
        if not self.copies:
            return self.train_url
        self.local_output = os.path.join(self.cache_dir, "output")
        if resume:
            self._copy_once(self.train_url, self.local_output, "to resume")
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
