"""The `vmoe://` config source: vmoe's schemas and model options (runner/command/config_store.py's
VmoeStore) as Hydra's structured source serves its ConfigStore's, read from the store at each call
instead of held. Hydra deep-copies every source at every composition; this one holds only its
name and path (what Hydra's own fix for its structured source, facebookresearch/hydra#2928,
does)."""
from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin

from runner.command.config_store import VmoeStore


class VmoeConfigSource(ConfigSource):
  @staticmethod
  def scheme() -> str:
    return "vmoe"

  def load_config(self, config_path: str) -> ConfigResult:
    stored = VmoeStore().load(self._normalize_file_name(config_path))  # a copy of the node
    return ConfigResult(config=stored.node, path=f"{self.scheme()}://{self.path}",
                        provider=stored.provider or self.provider,
                        header={"package": stored.package})

  def available(self) -> bool:
    return True

  def is_group(self, config_path: str) -> bool:
    return VmoeStore().get_type(config_path.rstrip("/")) == ObjectType.GROUP

  def is_config(self, config_path: str) -> bool:
    name = self._normalize_file_name(config_path.rstrip("/"))
    return VmoeStore().get_type(name) == ObjectType.CONFIG

  def list(self, config_path: str, results_filter: ObjectType | None) -> list[str]:
    found: list[str] = []
    for name in VmoeStore().list(config_path):
      self._list_add_result(files=found, file_path=f"{config_path}/{name}", file_name=name,
                            results_filter=results_filter)
    return sorted(set(found))


class VmoeSearchPath(SearchPathPlugin):
  """Puts the vmoe:// source on every search path, after the config folders."""

  def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
    search_path.append(provider="vmoe", path="vmoe://runner")
