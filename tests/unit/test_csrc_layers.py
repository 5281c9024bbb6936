"""Tier 1: the C extension's files call one way (Note [One direction in C] in csrc/module.c).

Reads csrc/*.c (no build needed): which file defines each external symbol (a function or
datum not declared static) and which other file names it — a call, or a function put in a
method table. The file-level graph must have no cycle, and module.c (the module's entry)
must be named by no other file."""
import re
from pathlib import Path

CSRC = Path(__file__).parents[2] / "csrc"

_NOISE = re.compile(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|'
                    r'^\s*#(?:[^\n]*\\\n)*[^\n]*',
                    re.S | re.M)
_IDENT = re.compile(r"[A-Za-z_]\w*")


def _code(text):
    """The C text without comments, string and character literals or preprocessor lines."""
    return _NOISE.sub(" ", text)


def _top_level(code):
    """The text at brace depth 0, with every braced body replaced by one '{}'."""
    out, depth = [], 0
    for ch in code:
        if ch == "{":
            if depth == 0:
                out.append("{}")
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def exported(code):
    """The symbols a file defines with external linkage: top-level definitions not static."""
    names = set()
    for decl, end in re.findall(r"([^;]*?)(;|\{\})", _top_level(code)):
        if re.search(r"\b(static|typedef|extern)\b", decl):
            continue
        fn = re.search(r"\w[\s*]+([A-Za-z_]\w*)\s*\([^()]*(?:\([^()]*\)[^()]*)*\)\s*$", decl)
        if fn and end == "{}":  # a function definition: its body follows
            names.add(fn.group(1))
            continue
        datum = re.search(r"\w[\s*]+([A-Za-z_]\w*)\s*(?:\[[^\]]*\])*\s*=", decl)
        if datum:  # an initialised definition at file scope
            names.add(datum.group(1))
    return names


def call_graph(sources):
    """{file: {other file it names}} over `sources` ({name: C text})."""
    codes = {name: _code(text) for name, text in sources.items()}
    owner = {}
    for name, code in codes.items():
        for sym in exported(code):
            assert sym not in owner, f"{sym} defined in {owner[sym]} and {name}"
            owner[sym] = name
    return {name: {owner[i] for i in set(_IDENT.findall(code)) if owner.get(i, name) != name}
            for name, code in codes.items()}


def cycle(graph):
    """One cycle of `graph` as a list of files, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _sources():
    return {p.name: p.read_text() for p in sorted(CSRC.glob("*.c"))}


def test_the_c_files_call_one_way():
    graph = call_graph(_sources())
    assert {"module.c", "context.c", "small.c", "exchange.c"} <= set(graph)
    assert cycle(graph) is None, f"a cycle among csrc's files: {' -> '.join(cycle(graph))}"
    callers = sorted(name for name, callees in graph.items() if "module.c" in callees)
    assert callers == [], f"module.c is the entry, named by no other file; named by {callers}"


def rows(note_text):
    """{file: its row} of the table in Note [One direction in C] (0 the top row)."""
    lines = note_text[note_text.index("Note [One direction in C]"):].splitlines()[2:]
    table = []
    for line in lines:
        files = re.match(r"\s*\*\s{3}((?:\w+\.c\s+)+)", line)
        if not files:
            break
        table.append(files.group(1).split())
    return {name: row for row, names in enumerate(table) for name in names}


def test_every_call_goes_down_the_documented_rows():
    """Note [One direction in C] names each file's row; a file calls only lower rows."""
    sources = _sources()
    row = rows(sources["module.c"])
    assert sorted(row) == sorted(sources), "every csrc/*.c has one row in the Note"
    graph = call_graph(sources)
    upward = [f"{a} -> {b}" for a in graph for b in graph[a] if row[b] <= row[a]]
    assert upward == [], upward
    assert "context.c" in graph["small.c"] and "small.c" in graph["exchange.c"]
    assert row["small.c"] < row["context.c"] and row["module.c"] == 0


def test_a_planted_cycle_is_found():
    """The check on a copy of the sources where context.c calls back into small.c (the cycle
    the layering removed) and where a file calls the module's entry: both caught."""
    sources = _sources()
    planted = dict(sources)
    planted["context.c"] += "\nint planted(void) { return mp_small_init(); }\n"
    found = cycle(call_graph(planted))
    assert found and "context.c" in found and "small.c" in found, found
    entry = dict(sources)
    entry["module.c"] += "\nint mp_entry_helper(void) { return 0; }\n"
    entry["kernels.c"] += "\nstatic int planted(void) { return mp_entry_helper(); }\n"
    assert "module.c" in call_graph(entry)["kernels.c"]


def test_the_parser_reads_definitions_calls_and_tables():
    a = ('/* f_b() in a comment */\nstatic int hidden(void) { return 0; }\n'
         'int f_a(int x,\n        int (*cb)(void)) { return f_b("f_c()"); }\n'
         'const char doc_a[] = "x";\n'
         'static PyMethodDef t[] = {{"n", (PyCFunction)f_d, 0, doc_a}};\n')
    b = "#include \"a.h\"\nint f_b(const char *s) { return f_a(1, 0); }\n"
    c = "PyObject *f_c(void) { return NULL; }\nvoid f_d(void) {}\n"
    assert exported(_code(a)) == {"f_a", "doc_a"}
    assert call_graph({"a.c": a, "b.c": b, "c.c": c}) == {
        "a.c": {"b.c", "c.c"}, "b.c": {"a.c"}, "c.c": set()}
    assert cycle({"a.c": {"b.c", "c.c"}, "b.c": {"a.c"}, "c.c": set()}) == ["a.c", "b.c", "a.c"]
