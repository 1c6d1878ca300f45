"""A deployment's settings: deploy/config.env (every key, with its default) < a profile < the
environment < KEY=VALUE arguments. Only keys that config.env defines are accepted.

Env files are KEY=VALUE lines without quotes or interpolation, comments on their own lines, so
that docker compose reads them exactly as we do.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

DEPLOY_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = DEPLOY_DIR.parent
DEFAULTS_FILE = DEPLOY_DIR / "config.env"
PROFILES_DIR = DEPLOY_DIR / "profiles"

# Keys that reach every service process as environment variables (when non-empty).
SERVICE_ENV_PREFIXES = ("NCCL_", "GLOO_", "MC_", "PYTORCH_", "CUDA_", "TORCH_", "NVSHMEM_", "GLOG_", "PDFLASH_", "OMP_")
# Keys that change what a client does, not the stack: a running stack is reused across them.
CLIENT_KEYS = ("RUN_ID", "KEEP_ON_FAILURE", "RESULTS_DIR", "POLL_INTERVAL", "START_TIMEOUT", "STOP_TIMEOUT")
CLIENT_PREFIXES = ("SMOKE_", "BENCH_")


class ConfigError(ValueError):
    """A setting is missing, unknown or refused; the message says which and why."""


def read_env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(f"{path}:{n}: expected KEY=VALUE, got {raw!r}")
        value = value.strip()
        if value[:1] in ("'", '"') or "${" in value:
            raise ConfigError(f"{path}:{n}: {key}: no quotes or ${{...}} in env files (compose reads them too)")
        values[key] = value
    return values


def profile_path(name: str) -> Path:
    """A profile by name (deploy/profiles/NAME.env) or by path."""
    p = Path(name)
    if p.suffix == ".env" or "/" in name:
        return p if p.is_absolute() else (Path.cwd() / p)
    return PROFILES_DIR / f"{name}.env"


@dataclass(frozen=True)
class Config:
    values: dict[str, str]
    profile: str  # the profile file as given
    overrides: dict[str, str]  # from the environment and KEY=VALUE arguments, for the record

    def __getitem__(self, key: str) -> str:
        return self.values[key]

    def get_int(self, key: str) -> int:
        try:
            return int(self.values[key])
        except ValueError:
            raise ConfigError(f"{key}={self.values[key]!r} is not an integer") from None

    def items(self):
        return sorted(self.values.items())

    def service_env(self) -> dict[str, str]:
        return {k: v for k, v in sorted(self.values.items()) if v and k.startswith(SERVICE_ENV_PREFIXES)}

    def stack_items(self) -> list[tuple[str, str]]:
        """What defines the running stack (not the client's settings)."""
        return [(k, v) for k, v in self.items() if k not in CLIENT_KEYS and not k.startswith(CLIENT_PREFIXES)]

    def stack_digest(self) -> str:
        text = "".join(f"{k}={v}\n" for k, v in self.stack_items())
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def dump(self) -> str:
        return "".join(f"{k}={v}\n" for k, v in self.items())


def load_config(profile: str, environ: Mapping[str, str] = os.environ, args: Mapping[str, str] | None = None) -> Config:
    values = read_env_file(DEFAULTS_FILE)
    path = profile_path(profile)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.env")))
        raise ConfigError(f"no profile {profile!r} ({path}); known profiles: {known}")
    for key, value in read_env_file(path).items():
        if key not in values:
            raise ConfigError(f"{path}: unknown key {key} (every key must be in {DEFAULTS_FILE.name})")
        values[key] = value
    overrides = {k: v for k, v in environ.items() if k in values and values[k] != v}
    for key, value in (args or {}).items():
        if key not in values:
            raise ConfigError(f"unknown setting {key} (every key must be in {DEFAULTS_FILE.name})")
        overrides[key] = value
    values.update(overrides)
    return Config(values, profile, dict(sorted(overrides.items())))

