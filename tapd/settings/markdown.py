"""The table of every setting on docs/SETTINGS.md, made from the settings table."""

from pathlib import Path

from tapd.settings import EMITTER_SETTINGS, SETTINGS
from tapd.settings.setting import Setting

NO_VARIABLE = "(none)"  # the variable cell of a setting that only `tapd.configure()` sets


def _type_text(setting: Setting) -> str:
    if setting.choices:
        return " \\| ".join(f"`{choice}`" for choice in setting.choices)
    if setting.words:
        return " \\| ".join(["boolean", *(f"`{word}`" for word in setting.words)])
    names = {
        bool: "boolean",
        int: "integer",
        float: "seconds"
        if "timeout" in setting.name or setting.name.endswith(("_grace", "_after"))
        else "number",
        Path: "path",
    }
    return names.get(setting.base_type, "text")


def markdown_table() -> str:
    """docs/SETTINGS.md's table: one row per setting, those without a TAPD_* variable
    too (`python -m tapd.settings --markdown`)."""
    rows = [
        "| variable | read by | type | default | also | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for setting in SETTINGS:
        also = []
        if setting.flag:
            also.append(
                f"`{setting.flag}`" if setting.global_flag else f"`tapd start {setting.flag}`"
            )
        if setting.toml:
            also.append(f"TOML `{setting.name}`")
        if "emitter" in setting.readers and setting in EMITTER_SETTINGS:
            also.append(f"`tapd.configure({setting.name}=)`")
        cells = [
            f"`{setting.variable}`" if setting.variable else NO_VARIABLE,
            ", ".join(setting.readers),
            _type_text(setting),
            setting.shown_default.replace("|", "\\|"),
            ", ".join(also),
            setting.help.replace("|", "\\|"),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"
