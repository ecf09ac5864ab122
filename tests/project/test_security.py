"""Static security checks over the project's own Python files (parsed with ast, never imported):

- every `torch.load` passes `weights_only=True` explicitly (older torch defaults to full unpickling);
- nothing unpickles or evaluates data: no pickle / cPickle / dill / joblib / marshal / shelve loads, no
  `pickle.Unpickler`, no `eval` / `exec`, no `numpy.load(allow_pickle=True)`, no `yaml.load` without a safe loader;
- the hf_tiny modules shipped as remote code (the modeling and configuration files and every module they import,
  transitively) import only the standard library, torch, transformers and sibling modules (`from .x import y`),
  import nothing dynamically, start no processes and import no networking module, and call no Hub download or
  upload function.

Each checker is also run on a small source with violations (negative controls), so a checker that stopped
finding anything would fail here. tests/ecosystem/test_remote_code.py checks the files a saved model folder really
carries; this file checks the source tree they come from, and every other project file for the load rules.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO_ROOT / "hf_tiny"

ALLOWED_THIRD_PARTY = {"torch", "transformers"}
NETWORK_MODULES = {
    "socket", "ssl", "http", "urllib", "urllib3", "ftplib", "smtplib", "poplib", "imaplib", "telnetlib", "xmlrpc",
    "socketserver", "asyncio", "requests", "httpx", "aiohttp", "websocket", "websockets", "huggingface_hub",
}
PROCESS_MODULES = {"subprocess", "multiprocessing", "pty"}
# Hub functions that download or upload (transformers re-exports some of huggingface_hub's)
HUB_FUNCTIONS = {
    "hf_hub_download", "snapshot_download", "cached_file", "cached_files", "HfApi", "create_repo", "upload_file",
    "upload_folder", "urlopen", "download_url",
}
UNPICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "joblib", "marshal", "shelve", "cloudpickle"}
UNPICKLING_CALLS = {"load", "loads", "Unpickler", "open"}


def project_files() -> list[Path]:
    """Every .py file of the project (hidden folders and caches excluded)."""
    files = []
    for path in sorted(REPO_ROOT.rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).parts
        if any(part.startswith(".") or part == "__pycache__" or part in ("build", "dist") for part in parts):
            continue
        files.append(path)
    return files


def dotted_name(node: ast.AST) -> str | None:
    """'torch.load' for Attribute(Name('torch'), 'load'); None for anything that is not a plain dotted name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted_name(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def imported_aliases(tree: ast.AST) -> dict[str, str]:
    """local name -> dotted origin, for `import x as y` and `from x import y as z` anywhere in the file."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def resolved_call_name(call: ast.Call, aliases: dict[str, str]) -> str | None:
    name = dotted_name(call.func)
    if name is None:
        return None
    head, _, rest = name.partition(".")
    origin = aliases.get(head, head)
    return f"{origin}.{rest}" if rest else origin


def _keyword(call: ast.Call, name: str):
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    return None


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_loads(source: str) -> list[str]:
    """Every call in `source` that may unpickle or evaluate data, as 'line N: description'."""
    tree = ast.parse(source)
    aliases = imported_aliases(tree)
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = resolved_call_name(node, aliases)
        if name is None:
            continue
        where = f"line {node.lineno}"
        if name in ("torch.load", "torch.serialization.load"):
            if not _is_true(_keyword(node, "weights_only")):
                problems.append(f"{where}: {name} without weights_only=True")
        elif name.split(".")[0] in UNPICKLING_MODULES and name.split(".")[-1] in UNPICKLING_CALLS:
            problems.append(f"{where}: {name} unpickles data")
        elif name in ("eval", "exec", "builtins.eval", "builtins.exec"):
            problems.append(f"{where}: {name}() evaluates code")
        elif name in ("numpy.load", "np.load") and _is_true(_keyword(node, "allow_pickle")):
            problems.append(f"{where}: {name}(allow_pickle=True) unpickles data")
        elif name == "yaml.load":
            loader = _keyword(node, "Loader")
            if loader is None and len(node.args) > 1:
                loader = node.args[1]
            if loader is None or "Safe" not in (dotted_name(loader) or ""):
                problems.append(f"{where}: yaml.load without a safe Loader")
        elif name == "yaml.unsafe_load":
            problems.append(f"{where}: yaml.unsafe_load")
    return problems


@pytest.mark.parametrize("path", project_files(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_file_unpickles_or_evaluates_untrusted_data(path):
    assert unsafe_loads(path.read_text(encoding="utf-8")) == []


def test_unsafe_load_checker_finds_every_kind():
    source = (
        "import torch, pickle, yaml\nimport numpy as np\nfrom torch import load as tl\nimport dill as d\n"
        "torch.load('a')\n"                          # 5
        "torch.load('a', weights_only=False)\n"      # 6
        "tl('a')\n"                                  # 7
        "pickle.loads(b'')\n"                        # 8
        "d.load(open('a', 'rb'))\n"                  # 9
        "eval('1')\n"                                # 10
        "np.load('a', allow_pickle=True)\n"          # 11
        "yaml.load('a')\n"                           # 12
        "pickle.Unpickler(None)\n"                   # 13
        "torch.load('a', weights_only=True)\n"       # fine
        "yaml.load('a', Loader=yaml.SafeLoader)\n"   # fine
        "pickle.dumps(1)\n"                          # fine: writing is not loading
        "model.eval()\n"                             # fine: a method called eval
    )
    lines = sorted(int(problem.split(":")[0].split()[1]) for problem in unsafe_loads(source))
    assert lines == [5, 6, 7, 8, 9, 10, 11, 12, 13]


# ---------------------------------------------------------------------------------------------------------------
# Remote code: what ships with a saved model
# ---------------------------------------------------------------------------------------------------------------


def shipped_modules() -> list[str]:
    """Modules transformers copies next to a saved model: every configuration_* / modeling_* file and, recursively,
    the sibling modules they import with `from .x import ...`."""
    pending = sorted(p.stem for p in PACKAGE_DIR.glob("*.py") if p.stem.startswith(("configuration_", "modeling_")))
    shipped: set[str] = set()
    while pending:
        name = pending.pop()
        if name in shipped:
            continue
        shipped.add(name)
        tree = ast.parse((PACKAGE_DIR / f"{name}.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                pending.append(node.module.split(".")[0])
    return sorted(shipped)


def optional_imports(tree: ast.AST) -> set[ast.AST]:
    """Imports inside a `try:` whose handler catches ImportError: the file works without them (an optional
    accelerator package), and transformers' own remote-code import check skips them the same way."""
    optional = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        caught = {dotted_name(h.type) for h in node.handlers if h.type is not None}
        caught |= {dotted_name(e) for h in node.handlers if isinstance(h.type, ast.Tuple) for e in h.type.elts}
        if caught & {"ImportError", "ModuleNotFoundError"}:
            optional |= {n for statement in node.body for n in ast.walk(statement) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return optional


def remote_code_problems(source: str) -> list[str]:
    tree = ast.parse(source)
    optional = optional_imports(tree)
    problems = []
    for node in ast.walk(tree):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            modules = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level > 1 or (node.level == 1 and not node.module):
                problems.append(f"{where}: relative import other than `from .sibling import name`")
                continue
            modules = [] if node.level == 1 else [node.module.split(".")[0]]
        else:
            modules = []
        for module in modules:
            if module in NETWORK_MODULES:
                problems.append(f"{where}: imports the networking module {module}")
            elif module in PROCESS_MODULES:
                problems.append(f"{where}: imports {module}, which starts processes")
            elif node in optional:
                continue  # an optional package (still never a networking or process module)
            elif module not in sys.stdlib_module_names and module not in ALLOWED_THIRD_PARTY and module != "__future__":
                problems.append(f"{where}: imports {module}, which is neither stdlib, torch nor transformers")
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name in HUB_FUNCTIONS:
                    problems.append(f"{where}: imports the Hub function {alias.name}")
        if isinstance(node, ast.Call):
            name = dotted_name(node.func) or ""
            last = name.split(".")[-1]
            if name in ("__import__", "importlib.import_module", "import_module"):
                problems.append(f"{where}: dynamic import {name}()")
            elif name in ("os.system", "os.popen") or name.startswith(("os.exec", "os.spawn")):
                problems.append(f"{where}: {name}() starts a process")
            elif last in HUB_FUNCTIONS:
                problems.append(f"{where}: calls the Hub function {name}()")
    return problems


def test_the_shipped_set_is_what_transformers_copies():
    shipped = shipped_modules()
    assert {"modeling_encoder", "modeling_causal", "modeling_seq2seq", "layers", "attention", "step", "engines",
            "runtime", "rope", "modeling_base", "validation", "transformers_api"} <= set(shipped)
    assert "__init__" not in shipped  # the package itself never ships


@pytest.mark.parametrize("module", shipped_modules())
def test_shipped_module_imports_nothing_beyond_torch_transformers_and_makes_no_network_calls(module):
    assert remote_code_problems((PACKAGE_DIR / f"{module}.py").read_text(encoding="utf-8")) == []


def test_remote_code_checker_finds_every_kind():
    source = (
        "import numpy\n"                                              # 1
        "from .layers import x\n"                                     # fine
        "from . import layers\n"                                      # 3
        "from ..pkg import y\n"                                       # 4
        "def f():\n"
        "    import urllib.request\n"                                 # 6
        "    from huggingface_hub import hf_hub_download\n"           # 7 (module) and 7 (function)
        "    import subprocess\n"                                     # 8
        "    __import__('requests')\n"                                # 9
        "    os.system('curl x')\n"                                   # 10
        "    from transformers.utils import cached_file\n"            # 11
        "    transformers.utils.hub.cached_file('a', 'b')\n"          # 12
        "import torch, transformers, json\n"                          # fine
        "try:\n"
        "    import flash_attn\n"                                      # fine: optional
        "    import requests\n"                                        # 16: optional, but networking
        "except ImportError:\n"
        "    flash_attn = None\n"
        "try:\n"
        "    import scipy\n"                                           # 20: required (nothing catches ImportError)
        "except ValueError:\n"
        "    pass\n"
    )
    lines = sorted(int(problem.split(":")[0].split()[1]) for problem in remote_code_problems(source))
    assert lines == [1, 3, 4, 6, 7, 7, 8, 9, 10, 11, 12, 16, 20]
