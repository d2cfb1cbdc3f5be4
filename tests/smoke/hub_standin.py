"""A stand-in for huggingface_hub's HfApi, for the push tests without network: a run finds it through the documented
seam `RLHFKIT_HUB_API=tests.smoke.hub_standin:StandInApi` and it appends each call, as one JSON line, to the file
that HUB_STANDIN_LOG names (an upload lists the files it would send, filtered by huggingface_hub itself)."""

import json
import os

from huggingface_hub.utils import filter_repo_objects


class StandInApi:
    def _record(self, call: dict) -> None:
        with open(os.environ["HUB_STANDIN_LOG"], "a") as f:
            f.write(json.dumps(call) + "\n")

    def create_repo(self, repo_id, **kwargs):
        self._record({"call": "create_repo", "repo_id": repo_id, **kwargs})

    def upload_folder(self, *, repo_id, folder_path, path_in_repo=None, ignore_patterns=None, delete_patterns=None, **kw):
        files = sorted(os.path.relpath(os.path.join(d, f), folder_path) for d, _, fs in os.walk(folder_path) for f in fs)
        self._record({"call": "upload_folder", "repo_id": repo_id, "folder": os.path.basename(folder_path),
                      "path_in_repo": path_in_repo, "files": list(filter_repo_objects(files, ignore_patterns=ignore_patterns)),
                      "delete_patterns": delete_patterns, "commit_message": kw["commit_message"]})


class UploadFails(StandInApi):
    """The repo is created, every upload fails as a dropped connection would."""

    def upload_folder(self, **kwargs):
        raise ConnectionError("connection reset by peer")


class NoWriteAccess(StandInApi):
    """The token cannot create the repo (as a read-only token or someone else's namespace)."""

    def create_repo(self, repo_id, **kwargs):
        raise PermissionError(f"403 Forbidden: you cannot create {repo_id}")
