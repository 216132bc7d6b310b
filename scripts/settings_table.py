"""Print the README's settings tables from the settings models (flags, env vars, defaults)."""

from __future__ import annotations

from pydantic_settings import BaseSettings

from api.settings import ApiSettings
from relaylm.settings_options import default_text, env_name
from shared.settings import CommonSettings
from worker.settings import WorkerSettings


def table(settings_cls: type[BaseSettings], skip: set[str]) -> str:
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for name, info in settings_cls.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        rows.append(f"| `{flag}` | `{env_name(settings_cls, name)}` | `{default_text(info)}` | {info.description} |")
    return "\n".join(rows)


if __name__ == "__main__":
    common = set(CommonSettings.model_fields)
    print("Both processes:\n")
    print(table(CommonSettings, set()))
    print("\nAPI (`relaylm api`, and `relaylm serve`):\n")
    print(table(ApiSettings, common))
    print("\nWorker (`relaylm worker`, and `relaylm serve`, which takes `--model` several times):\n")
    print(table(WorkerSettings, common))
