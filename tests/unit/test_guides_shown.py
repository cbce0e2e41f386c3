"""What the cluster guides show and never run (docs/how-to/slurm.md, clusters.md,
containers.md): their shell parses, the container recipes use only options that Apptainer,
enroot, pyxis and srun have, a Slurm template names only fields ipyparallel fills in, the
launcher settings they pass exist, and each claim once found wrong against the code
(the checkpoint "latest" means, the wait for a replacement engine, the errors quoted, one
controller_ip advice, what has run on a GPU, what the tutorials teach) stays true.
No engine starts here."""

from __future__ import annotations

import ast
import inspect
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

import fsdp_nb
from fsdp_nb.runtime.launch_settings import engine_launcher_class, split_cluster_kwargs

REPO = Path(__file__).resolve().parents[2]
HOW_TO = REPO / "docs" / "how-to"
TUTORIALS = REPO / "docs" / "tutorials"


def _blocks(text: str, lang: str) -> list[str]:
    """The ```{code-block} <lang>``` blocks of a page: shown, never run."""
    return re.findall(rf"^```\{{code-block\}} {lang}\n(.*?)^```$", text, flags=re.S | re.M)


def _page(stem: str) -> str:
    return (HOW_TO / f"{stem}.md").read_text()


def _flat(text: str) -> str:
    return " ".join(text.split())


def _bash(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True, timeout=30)


# -- the shell parses -------------------------------------------------------------------

NOT_BASH_YET: dict[str, str] = {}
"""Blocks known not to parse, each with why: strict, so a mended one must leave the list."""


def _bash_params() -> list:
    out = []
    for page in sorted(HOW_TO.glob("*.md")):
        for i, code in enumerate(_blocks(page.read_text(), "bash")):
            key = f"{page.stem}-{i + 1}"
            marks = [pytest.mark.xfail(strict=True, reason=NOT_BASH_YET[key])] if key in NOT_BASH_YET else []
            out.append(pytest.param(code, id=key, marks=marks))
    return out


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("code", _bash_params())
def test_every_bash_block_of_a_how_to_page_parses(code):
    """Catches a shown script that bash would refuse (a quote left open, a `<placeholder>`
    read as a redirection): `#SBATCH` lines are comments to bash, so a job script counts."""
    result = _bash(code)
    assert result.returncode == 0, result.stderr


# -- the Apptainer definition -----------------------------------------------------------

SECTIONS = {"%post", "%environment", "%runscript", "%labels", "%files", "%help", "%test", "%setup", "%startscript"}
"""The definition file sections of Apptainer's manual ("Definition Files") a page may use."""
SHELL_SECTIONS = {"%post", "%environment", "%runscript", "%test", "%setup", "%startscript"}
NGC_PYTORCH = re.compile(r"nvcr\.io/nvidia/pytorch:(\d{2})\.(\d{2})-py3")


def definition(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """An Apptainer definition file's header (keyword -> value, in order) and its
    sections (name -> body); ValueError for a header line after a section, or a header
    line that is no ``Keyword: value``."""
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("%"):
            current = sections.setdefault(line.split()[0], [])
        elif current is not None:
            current.append(line)
        elif line.strip():
            key, sep, value = line.partition(":")
            if not sep or " " in key:
                raise ValueError(f"not a header line: {line!r}")
            header[key] = value.strip()
    return header, {name: "\n".join(body) for name, body in sections.items()}


def test_the_containers_pages_apptainer_definition_parses():
    """Catches a definition Apptainer would refuse or run wrong: the header not
    `Bootstrap: docker` then `From:` an NGC PyTorch image with a YY.MM-py3 tag, a section
    Apptainer does not have, a shell section bash cannot parse, a `%files` line that is
    not `source destination`."""
    (text,) = _blocks(_page("containers"), "singularity")
    header, sections = definition(text)
    assert list(header)[:2] == ["Bootstrap", "From"] and header["Bootstrap"] == "docker"
    tag = NGC_PYTORCH.fullmatch(header["From"])
    assert tag and 1 <= int(tag.group(2)) <= 12, header["From"]
    assert "%post" in sections and set(sections) <= SECTIONS
    for name in SHELL_SECTIONS & set(sections):
        assert _bash(sections[name]).returncode == 0, (name, _bash(sections[name]).stderr)
    assert all(len(line.split()) == 2 for line in sections.get("%files", "").splitlines() if line.strip())
    with pytest.raises(ValueError):  # the parser itself refuses what is no definition
        definition("Bootstrap docker\n")
    assert not NGC_PYTORCH.fullmatch("nvcr.io/nvidia/pytorch:latest")


# -- the container and srun commands ------------------------------------------------------

SRUN = {"--overlap", "--nodes", "--ntasks", "--nodelist", "--jobid", "--kill-on-bad-exit",
        "--cpus-per-task", "--gpus-per-task", "--ntasks-per-node", "--export", "--partition", "--time"}
"""srun options the pages use, each in Slurm's srun(1)."""
PYXIS = {"--container-image", "--container-mounts", "--container-workdir", "--container-name", "--container-save",
         "--container-mount-home", "--no-container-mount-home", "--container-remap-root", "--no-container-remap-root",
         "--container-entrypoint", "--no-container-entrypoint", "--container-writable", "--container-readonly",
         "--container-env"}
"""srun options pyxis adds (its args.c, ``spank_opts``)."""
ENROOT = {"import": {"--output", "-o"}}
"""enroot subcommands and their options (enroot's doc/cmd/import.md)."""
APPTAINER = {"exec": {"--nv", "--bind", "-B"}, "build": {"--fakeroot", "--notest"}}
"""apptainer subcommands and their options (Apptainer's ``apptainer <command> --help``)."""


def _commands(code: str) -> list[list[str]]:
    """Each srun, enroot and apptainer command of a shell block, split as the shell would
    (continuation lines joined, comments and a trailing ``&`` dropped), from that word on."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and words[-1] == "&":
            words.pop()
        for i, word in enumerate(words):
            if word in ("srun", "enroot", "apptainer") and (i == 0 or words[i - 1] in ("&&", ";", "|")):
                out.append(words[i:])
                break
    return out


def option_problems(words: list[str]) -> list[str]:
    """The options of one command (srun, enroot, apptainer) that the tool does not have."""
    tool, rest = words[0], words[1:]
    if tool == "srun":
        known = SRUN | PYXIS
    else:
        sub, rest = rest[0], rest[1:]
        options = (ENROOT if tool == "enroot" else APPTAINER).get(sub)
        if options is None:
            return [f"{tool} has no command {sub}"]
        known = options
    found = []
    for word in rest:
        if not word.startswith("-"):
            break  # the program srun runs, or the command's own arguments
        if word.split("=", 1)[0] not in known:
            found.append(f"{tool}: {word.split('=', 1)[0]}")
    return found


@pytest.mark.parametrize("stem", ["containers", "slurm"])
def test_the_container_and_srun_commands_use_options_the_tools_have(stem):
    """Catches an option srun, pyxis, enroot or Apptainer does not have (a typo, one from
    another tool), and an enroot image that is not `docker://nvcr.io#nvidia/pytorch:YY.MM-py3`."""
    commands = [c for code in _blocks(_page(stem), "bash") for c in _commands(code)]
    assert commands
    assert [p for c in commands for p in option_problems(c)] == []
    if stem == "containers":
        tools = {c[0] for c in commands}
        assert {"srun", "enroot", "apptainer"} <= tools
        uris = [w for c in commands if c[0] == "enroot" for w in c if w.startswith("docker://")]
        assert uris and all(NGC_PYTORCH.fullmatch(u.replace("docker://nvcr.io#", "nvcr.io/")) for u in uris)
    assert option_problems(["srun", "--container-imag=x", "true"]) == ["srun: --container-imag"]


# -- Slurm templates and launcher settings -------------------------------------------------


def _slurm_job(tmp_path: Path, **settings: str):
    """The engine launcher fsdp_nb's launcher="slurm" takes, with these settings given."""
    cls = engine_launcher_class("slurm")
    return cls(profile_dir=str(tmp_path), cluster_id="c1", work_dir=str(tmp_path), **settings)


def _templates(stem: str) -> list[str]:
    """The job scripts (strings with #SBATCH lines) of a page's Python blocks."""
    return [node.value for code in _blocks(_page(stem), "python") for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "#SBATCH" in node.value]


def _fields(text: str) -> set[str]:
    """The names a template's fields use (`{n//4}`: n), doubled braces left out."""
    text = text.replace("{{", "").replace("}}", "")
    return {name for field in re.findall(r"\{([^{}]+)\}", text) for name in re.findall(r"[A-Za-z_]\w*", field)}


@pytest.mark.parametrize("stem", ["slurm", "containers"])
def test_a_pages_template_is_filled_in_by_the_launcher(stem, tmp_path):
    """Catches a template field that ipyparallel's Slurm launcher does not fill in (the
    job would fail as it is submitted): each shown template is written out by the launcher
    itself, with no optional setting given, as the pages' sessions give none."""
    templates = _templates(stem)
    assert templates
    for template in templates:
        job = _slurm_job(tmp_path)
        job.batch_template = template
        job.write_batch_script(8)
        written = Path(job.batch_file).read_text()
        assert "#SBATCH --ntasks=8" in written and "{" not in written.replace("${", ""), written


def test_the_fields_slurm_md_says_are_filled_in_are_and_the_others_are_not(tmp_path):
    """Catches the page naming a field the launcher never fills in (`{queue}`-style fields
    it does not have), or saying one is always there when it exists only once its setting
    is given (`{account}`): read from the launcher, not written down here."""
    text = _page("slurm")
    always = _fields(re.search(r"^- always:(.*?)^- only when", text, flags=re.S | re.M).group(1))
    given = _fields(re.search(r"^- only when you give the setting:(.*?)\n\n", text, flags=re.S | re.M).group(1))
    bare = set(_slurm_job(tmp_path).context)
    full = set(_slurm_job(tmp_path, queue="gpu", account="a", qos="q", timelimit="10", options="-x").context)
    assert always and given
    assert always <= bare and not (given & bare) and given <= full
    prose = [re.sub(r"(?<![\w=`/])\{\w+\}`[^`]*`", "", part)  # outside the blocks, less {term}`...` roles
             for part in text.split("```")[::2]]
    named = {name for part in prose for span in re.findall(r"`([^`\n]+)`", part)
             for field in re.findall(r"(?<!\{)\{([\w/+*. -]+)\}(?!\})", span) for name in _fields("{" + field + "}")}
    assert "n" in named and named - full == set()


def _launcher_calls(stem: str) -> list[tuple[str, dict]]:
    """(launcher, settings) of each `Session(..., launcher=...)` of a page's Python blocks:
    the keywords that are not Session's own, with their literal values (else a string)."""
    own = set(inspect.signature(fsdp_nb.Session.__init__).parameters) - {"cluster_kwargs"}
    out = []
    for code in _blocks(_page(stem), "python"):
        for node in ast.walk(ast.parse(code)):
            if not (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("Session")):
                continue
            kw = {k.arg: k.value for k in node.keywords if k.arg is not None}
            if "launcher" not in kw:
                continue
            settings = {}
            for name, value in kw.items():
                if name not in own:
                    try:
                        settings[name] = ast.literal_eval(value)
                    except ValueError:
                        settings[name] = "x"
            out.append((ast.literal_eval(kw["launcher"]), settings))
    return out


@pytest.mark.parametrize("stem", ["slurm", "clusters", "containers"])
def test_the_launcher_settings_a_page_passes_exist(stem):
    """Catches a setting a shown Session passes that neither ipyparallel's Cluster nor the
    launcher has (an `engine_comand=`): Session refuses it before anything starts, by the
    same `split_cluster_kwargs` used here."""
    calls = _launcher_calls(stem)
    assert calls
    for launcher, settings in calls:
        split_cluster_kwargs(launcher, settings)
    with pytest.raises(ValueError, match="engine_comand"):
        split_cluster_kwargs("slurm", {"engine_comand": ["python3"]})


# -- the claims once found wrong ------------------------------------------------------------


def _info(step: int, created: float, valid: bool = True):
    from fsdp_nb.formats.info import CheckpointInfo

    return CheckpointInfo(path=f"/runs/run1/step-{step}", kind="sharded", valid=valid, created=created,
                          extra={"step": step})


def test_the_recipe_after_a_jobs_end_loads_what_restore_latest_takes(monkeypatch):
    """Catches the recipe taking the highest step where `restore="latest"` takes the newest
    written: a run went back from step 9 to 6 and saved again, and step 8's save was cut
    short. The recipe of the page runs against that listing, beside `latest` itself."""
    from fsdp_nb.autosave import autosave

    listing = sorted([_info(9, 100.0), _info(6, 200.0), _info(8, 300.0, valid=False), _info(3, 50.0)],
                     key=lambda i: (i.step, i.created))  # as list_checkpoints orders them
    monkeypatch.setattr(fsdp_nb, "list_checkpoints", lambda root, **kw: listing)
    monkeypatch.setattr(autosave, "list_checkpoints", lambda root, **kw: listing)
    spec = SimpleNamespace(root="/runs/run1", storage_options=None)
    wanted = autosave.latest(SimpleNamespace(autosave=spec, suspended_autosave=None, last_autosave=None))
    (code,) = [c for c in _blocks(_page("slurm"), "python") if "list_checkpoints" in c]
    loaded = []
    sess = SimpleNamespace(load=lambda path, *a, **kw: loaded.append(path))
    exec(code, {"fsdp_nb": fsdp_nb, "sess": sess, "model": object()})
    assert loaded == [wanted] == ["/runs/run1/step-6"]
    assert [c for c in listing if c.valid][-1].path != wanted  # the highest valid step: what the old recipe took


def _quoted(text: str, error: str, starts: str = "") -> str:
    """The message the page quotes after `<error>: ` (the first that begins with
    ``starts``), whitespace made single."""
    found = re.search(rf"`{error}: ({re.escape(starts)}.*?)`", text, flags=re.S)
    assert found, f"the page quotes no {error}"
    return _flat(found.group(1))


def _cluster(**attrs):
    from fsdp_nb.runtime.cluster import EngineCluster

    c = object.__new__(EngineCluster)
    c.client = SimpleNamespace(ids=[0, 1, 2, 3])
    c.engine_ids, c._retired, c._known, c._launched, c.standby = [0, 1, 2, 3], set(), None, {}, None
    for name, value in attrs.items():
        setattr(c, name, value)
    return c


def test_slurm_md_says_the_wait_and_the_errors_a_replacement_gives(monkeypatch):
    """Catches the page's wait for a replacement engine differing from `EngineCluster.replace`'s,
    a quoted error that the code no longer says, and a second restart that would submit a
    second job (the page says it waits for the first)."""
    from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

    from fsdp_nb.recovery.restart_report import stopped_at
    from fsdp_nb.runtime import cluster as cluster_module

    text = _page("slurm")
    wait = inspect.signature(cluster_module.EngineCluster.replace).parameters["timeout"].default
    said = {float(s) for s in re.findall(r"waits (\d+) s", _flat(text))}
    assert said == {wait}
    from fsdp_nb.runtime.launch_settings import HEARTBEAT_MISSES, HEARTBEAT_MS

    beats = {float(s) for s in re.findall(r"missed their heartbeats for (\d+) s", _flat(text))}
    assert beats == {HEARTBEAT_MS * HEARTBEAT_MISSES / 1000}

    attached = _cluster(cluster=None)
    with pytest.raises(RuntimeError) as refused:
        attached.replace([3])
    assert str(refused.value) == _quoted(text, "RuntimeError", starts="rank(s)")

    submitted = []
    launched = _cluster(cluster=SimpleNamespace(engine_launcher_class=SlurmEngineSetLauncher,
                                                start_engines_sync=lambda **kw: submitted.append(kw)))
    monkeypatch.setattr(cluster_module, "wait_until", lambda *a, **kw: False)
    for _ in range(2):
        with pytest.raises(TimeoutError) as late:
            launched.replace([3])
        assert str(late.value) == _quoted(text, "TimeoutError")
    assert submitted == [{"n": 1}]
    why = stopped_at("replace the dead engines", late.value)
    first, last = re.search(r'The session is left unfinished: (.*?) \.\.\.; (.*?)\. Until then', _flat(text)).groups()
    assert why.startswith(first) and why.endswith(last)


def test_slurm_md_says_what_engines_that_each_see_gpu_0_get():
    """Catches the page's quoted error, or its advice (GPUs per node, so that local rank i
    takes cuda:i), going out of step with `gpu_indexes` and `choose_backend`."""
    from fsdp_nb.runtime.rendezvous import choose_backend, gpu_indexes
    from fsdp_nb.wire.probe import EngineProbe

    def probes(devices: int, visible: str) -> list[EngineProbe]:
        return [EngineProbe(host=f"gpu-node-{17 + r // 4}", pid=100 + r, addr=f"10.0.0.{r}", ifname="ib0",
                            launcher_rank=r, launcher_var="SLURM_PROCID", cuda_devices=devices,
                            visible_devices=visible) for r in range(8)]

    with pytest.raises(RuntimeError) as refused:
        choose_backend("nccl", probes(1, "0"))
    assert str(refused.value) == _quoted(_page("slurm"), "RuntimeError", starts="backend")
    assert choose_backend(None, probes(1, "0")) == "gloo" and gpu_indexes(probes(1, "0")) is None
    assert gpu_indexes(probes(4, "0,1,2,3")) == [0, 1, 2, 3, 0, 1, 2, 3]


ADVICE = re.compile(r"Give `controller_ip` (.*?)`\"\*\"`\.", flags=re.S)
WILDCARD = re.compile(r"""controller_ip\s*=\s*["']\*["']|--ip=["']?\*""")


def test_slurm_md_and_clusters_md_give_one_controller_ip_advice():
    """Catches the two pages advising differently (one `"*"`, one the host's address) and
    a shown command that listens on every interface after all."""
    advice = {stem: {_flat(a) for a in ADVICE.findall(_page(stem))} for stem in ("slurm", "clusters")}
    assert all(len(a) == 1 for a in advice.values()) and advice["slurm"] == advice["clusters"], advice
    shown = {stem: [m for code in _blocks(_page(stem), "bash") + _blocks(_page(stem), "python")
                    for m in WILDCARD.findall(code)] for stem in ("slurm", "clusters", "containers")}
    assert shown == {"slurm": [], "clusters": [], "containers": []}
    assert WILDCARD.search("ipcluster start --ip='*'") and WILDCARD.search('Session(controller_ip="*")')


STALE = {
    "slurm": {r"nothing to rebuild from": "restart(restore='latest') rebuilds from the autosave on disk",
              r"if c\.valid\]\[-1\]": "the highest step is not the newest written",
              r"fsdp_nb\.sbatch": "a file name that reads as a module of fsdp_nb"},
}
"""Sentences the code once contradicted, each with why."""


def test_the_cluster_guides_do_not_say_again_what_the_code_contradicted():
    """Catches a sentence coming back that the code contradicted."""
    found = [(stem, pattern, why) for stem, claims in STALE.items() for pattern, why in claims.items()
             if re.search(pattern, _page(stem))]
    assert found == []


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def test_merged_output_is_not_said_to_have_run_on_a_gpu_before_it_existed():
    """Catches the what-ran-where table saying the output row ran on a GPU at a commit
    before the ranks' output was merged (`merge_output` first in fsdp_nb), unless the cell
    says merged output never ran there (one rank has nothing to merge)."""
    first = (_git("log", "--reverse", "--format=%H", "-S", "merge_output", "--", "fsdp_nb") or "").split()
    if not first:
        pytest.skip("no git history here")
    for page in (REPO / "README.md", HOW_TO / "gpus.md"):
        table = page.read_text().split("<!-- what-ran-where", 1)[1]
        row = next(line for line in table.splitlines() if line.startswith("| session, `%%px`, `run`, output"))
        one_gpu, more = (cell.strip() for cell in row.split("|")[3:5])
        assert more == "never"
        if "merged across ranks, never" in one_gpu:
            continue
        for commit in re.findall(r"\b[0-9a-f]{7,40}\b", one_gpu):
            assert _git("merge-base", "--is-ancestor", first[0], commit) is not None, (page.name, commit)


FEATURES = {"sess.autosave(": "autosave", "sess.restart(": "restart", "sess.steps(": "steps", "sess.profile(": "profile",
            "Session.attach(": "attach", "sess.reload(": "reload", "sess.debug(": "pdb", "sess.plan(": "plan",
            "sess.resize(": "resize", "sess.status_widget(": "status widget", "export_safetensors(": "export"}
"""A call a tutorial makes -> the word its row in the tutorials' index must have."""


def test_the_tutorials_index_says_what_each_tutorial_teaches():
    """Catches a row that leaves out a feature its notebook teaches (04's autosave and
    restore, 05's step view). A notebook with no row yet is left to its author."""
    index = (TUTORIALS / "index.md").read_text()
    missing = []
    for nb in sorted(TUTORIALS.glob("*.ipynb")):
        rows = [line for line in index.splitlines() if line.startswith(f"| {{doc}}`{nb.stem[:2]} ")]
        if not rows:
            continue
        code = "\n".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
        missing += [(nb.stem, word) for call, word in FEATURES.items() if call in code and word not in rows[0]]
    assert missing == []
