"""Every answer whole: query schemas checked before any model loads, constrained outputs that close
within max_tokens (the budget steers them onto their shortest completion), numbers bounded in the
grammar, and every answer validated against its whole schema after decoding."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from docproc.pipeline.json_schema import SchemaProblem, check_schema, unenforced, violation
from docproc.pipeline.queries import QueryFileError, load_queries

PROMPT = "<|im_start|>user\nRead the invoice.<|im_end|>\n<|im_start|>assistant\n"


DEEP: dict[int, int] = {}  # id of a deeply nested schema -> its levels


def _deep(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    DEEP[id(schema)] = levels
    return schema


BAD_SCHEMAS = [  # (schema, what the message names)
    ({"type": "objekt"}, "'type'"),
    ({"type": "object", "properties": 5}, "'properties'"),
    ({"type": "object", "required": "a"}, "'required'"),
    ({"$ref": "#/$defs/missing"}, "points to nothing"),
    ({"$ref": "#"}, "circular"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "circular"),
    ({"$ref": "https://example.com/s.json"}, "inside the schema"),
    # a pointer through a key that is not a schema keyword: its target was never walked (numbers
    # left unbounded, a pattern naming a quote unchecked) though the grammar decodes it
    ({"$ref": "#/components/s", "components": {"s": {"type": "number"}}}, "points outside the schema's subschemas"),
    ({"properties": {"v": {"$ref": "#/$defs"}}, "$defs": {"properties": {"x": {"type": "number"}}}},
     "points outside the schema's subschemas"),  # (a map of subschemas, not one)
    # no finite value: decoding under them never ends (the grammar's forced text grew without bound)
    ({"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}, "no finite JSON value"),
    ({"$defs": {"a": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/a"}}}, "type": "object",
      "properties": {"x": {"$ref": "#/$defs/a"}}}, "at /properties/x"),
    ({"anyOf": [{"type": "string"}, {"$ref": "#/$defs/b"}], "$defs": {"b": {"type": "object", "properties": {
        "b": {"$ref": "#/$defs/b"}}, "required": ["b"]}}}, "at /anyOf/1"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "minProperties": 1}, "no finite JSON value"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False, "minProperties": 2},
     "minProperties asks for more properties than its properties allow"),  # (no recursion: not "refers back")
    ({"type": "array", "minItems": 1, "items": {"type": "object", "properties": {"a": {}}, "minProperties": 3}},
     "at /items: its minProperties"),  # (named where it is, not at the root)
    ({"type": "string", "minLength": 5, "maxLength": 2}, "'minLength' 5 and 'maxLength' 2"),
    ({"type": "string", "pattern": "(["}, "'pattern'"),
    ({"enum": []}, "'enum'"),
    ({"anyOf": 5}, "'anyOf'"),
    ({"type": "integer", "minimum": 9, "maximum": 1}, "'minimum' 9 and 'maximum' 1"),
    # nothing of the declared type: every answer was decoded and then failed (a whole batch's work)
    ({"type": "object", "properties": {"x": {"type": "integer", "const": "abc"}}, "required": ["x"]},
     "'const' at /properties/x/const"),
    ({"type": "integer", "enum": ["a", "b"]}, "'enum' at /enum holds no value of type integer"),
    ({"type": "number", "enum": [True]}, "no value of type number"),
    ({"type": "object", "properties": {"x": {}}, "required": ["y"], "additionalProperties": False},
     "required property 'y' at the root is not among its properties"),
    (_deep(200), "nested more than"),
    (_deep(1500), "nested more than"),
]


@pytest.mark.parametrize("schema,named", BAD_SCHEMAS, ids=[str(i) for i in range(len(BAD_SCHEMAS))])
def test_a_schema_that_cannot_be_used_is_named_before_any_model_loads(tmp_path, schema, named):
    check = pytest.raises(SchemaProblem, match=re.escape(named))
    with check:
        check_schema(schema)
    levels = DEEP.get(id(schema))
    text = (('{"type": "object", "properties": {"a": ' * levels + '{"type": "object"}' + "}}" * levels)
            if levels else json.dumps(schema))  # (json.dumps itself recurses too deep there)
    (tmp_path / "s.json").write_text(text)
    q = tmp_path / "q.toml"
    q.write_text('[[query]]\nname = "doc"\nquestion = "?"\ntype = "json"\nschema_file = "s.json"\n')
    with pytest.raises(QueryFileError, match=r"query 'doc': its schema cannot be used: .*" + re.escape(named)):
        load_queries(q)


def test_good_schemas_pass_and_recursion_through_a_value_is_allowed():
    check_schema({"type": ["string", "null"], "enum": ["a", None]})  # one member of the type is enough
    check_schema({"type": "integer", "const": 3.0})  # (a whole number, as JSON Schema counts it)
    check_schema({"type": "object", "required": ["y"], "additionalProperties": False,
                  "patternProperties": {"^y$": {}}})
    # a part nothing matches where an answer need not pass it: an alternative, an optional
    # property, an unused definition, inside `not`
    check_schema({"type": "object", "properties": {"x": {"anyOf": [{"type": "string", "const": 5},
                                                                    {"type": "integer"}]}}})
    check_schema({"type": "object", "properties": {"legacy": {"type": "string", "enum": [1]}}})
    check_schema({"$defs": {"old": {"type": "object", "additionalProperties": False, "required": ["z"]}}})
    check_schema({"type": "string", "not": {"type": "string", "const": 5}})
    with pytest.raises(SchemaProblem, match="/items/enum"):  # an array that must hold one
        check_schema({"type": "array", "minItems": 1, "items": {"type": "integer", "enum": ["a"]}})
    check_schema({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}})
    check_schema({"type": "object", "properties": {"n": {"$ref": "#"}}})  # optional: {} ends it
    check_schema({"$defs": {"b": {"type": "object", "properties": {"b": {"anyOf": [{"$ref": "#/$defs/b"},
                  {"type": "null"}]}}, "required": ["b"]}}, "$ref": "#/$defs/b"})  # null ends it
    # an anyOf is decoded alone (the keywords beside it are not): its null ends it
    check_schema({"$defs": {"N": {"anyOf": [{"type": "null"}, {"type": "object"}], "properties": {
        "next": {"$ref": "#/$defs/N"}}, "required": ["next"]}}, "$ref": "#/$defs/N"})
    check_schema({"type": "object", "properties": {"a": {"$ref": "#"}, "b": {"type": "string"}}, "minProperties": 1})
    # a long chain of $refs is checked in linear time (a quadratic check held a worker for minutes)
    chain = {"$defs": {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}},
                                 "required": ["x"]} for i in range(3000)}, "$ref": "#/$defs/d0"}
    chain["$defs"]["d3000"] = {"type": "string"}
    from docproc.json_finite import endless
    assert endless(chain) is None
    check_schema({"$defs": {"n": {"type": "number"}}, "type": "object", "properties": {"t": {"$ref": "#/$defs/n"}}})
    check_schema(_deep(48))
    load_queries(None)  # the default set's schema


def test_docproc_run_refuses_a_bad_schema_with_exit_2_naming_query_and_keyword(tmp_path):
    from docproc.cli import app

    (tmp_path / "in").mkdir()
    q = tmp_path / "q.toml"
    q.write_text('[[query]]\nname = "doc"\nquestion = "?"\ntype = "json"\nschema = { type = "objekt" }\n')
    res = CliRunner().invoke(app, ["run", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--queries", str(q),
                                   "--model", str(tmp_path / "no-model")])
    assert res.exit_code == 2, res.output
    assert "query 'doc'" in res.output and "'type'" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "out").exists()  # nothing was done


BEYOND_THE_GRAMMAR = [  # valid JSON Schema that xgrammar cannot compile: (schema, its reason)
    ({"type": "object", "properties": {"x": False}, "required": ["x"]}, "cannot accept any value"),
    ({"type": "integer", "minimum": 0.5}, "whole number"),
    ({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4}, "minimum greater than maximum"),
    ({"type": "string", "pattern": "(a)\\1"}, "Backreference"),
    ({"type": "string", "pattern": '^".$'}, "names a quote, a backslash or a control character"),
    ({"type": "object", "patternProperties": {"^a\\n": {"type": "integer"}}}, "would write unescaped"),
    ({"type": "string", "pattern": "^[a-z]{1,20000}$"}, "repeats 20,000 times: more than 1,000"),  # (61 s to build)
    ({"type": "string", "pattern": "^((a|b){1,500}c){1,50}$"}, "too large for xgrammar"),  # (not "names a quote")
    # counts that add up: in one pattern, repeated, and the strict strings' lengths
    ({"type": "string", "pattern": "^" + "x{1000}" * 9 + "$"}, "count 9,000 repetitions in all"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^[a-z]{1000}$"} for i in range(9)}},
     "more than 8,000"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 500} for i in range(17)}},
     "more than 8,000"),
    ({"type": "string", "pattern": "^\\\\{8000}$"}, "repeats 8,000 times"),  # (an escaped backslash before it)
]


@pytest.mark.parametrize("schema,reason", BEYOND_THE_GRAMMAR, ids=[str(i) for i in range(len(BEYOND_THE_GRAMMAR))])
def test_a_schema_the_grammar_cannot_compile_stops_the_run_with_exit_2_before_the_model_loads(
        tmp_path, schema, reason):
    from docproc.cli import app
    from docproc.engine.structured import compile_problem
    from docproc.sampling_params import StructuredOutputsParams

    check_schema(schema)  # valid JSON Schema: the checks made as the query file loads pass it
    assert reason in compile_problem(StructuredOutputsParams(json=json.dumps(schema)))
    if schema.get("type") != "integer" or "minimum" not in schema:
        return  # (one run through the CLI is enough)
    from PIL import Image

    (tmp_path / "in").mkdir()
    Image.new("RGB", (64, 64), "white").save(tmp_path / "in" / "a.png")
    q = tmp_path / "q.toml"
    q.write_text('[[query]]\nname = "n"\nquestion = "?"\ntype = "json"\nschema_file = "s.json"\n')
    (tmp_path / "s.json").write_text(json.dumps(schema))
    # OUT holds an earlier run's rows and tables: the refused run leaves the tables as they are
    # (it rewrote them, documents.parquet with the refused set's columns)
    from docproc.pipeline.runstore import RunStore

    out = tmp_path / "out"
    RunStore(out).write_part(1, [{"run_id": "r0", "path": "b.png", "root": str(tmp_path / "in"), "doc_status": "ok",
                                  "query": "vendor", "query_type": "string", "value": "Acme", "status": "ok",
                                  "config_fingerprint": "c0"}])
    for name in ("results.parquet", "documents.parquet"):
        (out / name).write_bytes(b"the earlier run's table")
    res = CliRunner().invoke(app, ["run", str(tmp_path / "in"), "--out", str(out), "--queries", str(q),
                                   "--log-json", "--format", "json,parquet,documents"])
    assert res.exit_code == 2, res.output
    assert all((out / n).read_bytes() == b"the earlier run's table" for n in ("results.parquet", "documents.parquet"))
    events = [json.loads(line) for line in res.output.splitlines() if line.startswith("{")]
    assert "load_start" not in {e["event"] for e in events}  # no model was loaded
    end = [e for e in events if e["event"] == "end"][0]
    assert end["fault"]["kind"] == "queries" and "query 'n'" in end["fault"]["message"]
    assert reason in end["fault"]["message"] and end["exit_code"] == 2


def test_a_pattern_xgrammar_would_write_unescaped_is_refused_and_the_rest_give_json_only():
    """xgrammar matches a string's pattern against its characters, written as JSON escapes where
    JSON needs them, unless the pattern names a quote, a backslash or a control character: then
    against the raw text between the quotes, and `.` or a class writes a bare quote or newline.
    Exactly the patterns whose grammars accept text that is not JSON are refused."""
    import itertools

    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from docproc.engine.structured import compile_problem
    from docproc.sampling_params import StructuredOutputsParams

    texts = ['"%s"' % "".join(t) for n in (1, 2, 3) for t in itertools.product('a"\\\nn', repeat=n)]

    def is_json(text):
        try:
            json.loads(text)
            return True
        except ValueError:
            return False

    refused = []
    for pattern in ['^".$', '^\\\\[^a]$', '^a.\\n$', '^"+$', '^[\\\\"]$', '^\\n{2}$',
                    '^.*$', '^[^\\n]*$', '^\\S+$', '^[ -~]+$', '^(a|")+$', '^[a"]+$', '^[^"]*$']:
        schema = {"type": "string", "pattern": pattern}
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        not_json = [t for t in texts if _is_grammar_accept_string(grammar, t) and not is_json(t)]
        problem = compile_problem(StructuredOutputsParams(json=json.dumps({"type": "array", "items": schema})))
        assert (problem is not None) == bool(not_json), (pattern, problem, not_json[:3])
        refused += [pattern] if problem else []
    assert len(refused) == 6, refused


def test_answers_are_validated_against_the_whole_schema():
    schema = {"type": "object", "required": ["a"], "additionalProperties": False, "properties": {
        "a": {"type": "integer", "not": {"const": 13}, "multipleOf": 2},
        "tags": {"type": "array", "uniqueItems": True, "items": {"type": "string"}},
        "kind": {"enum": ["x", "y"]}, "ref": {"type": "string"}},
        "if": {"properties": {"kind": {"const": "x"}}, "required": ["kind"]}, "then": {"required": ["ref"]},
        "dependentRequired": {"tags": ["kind"]}}
    assert violation({"a": 2}, schema) is None
    assert violation({"a": 2, "kind": "x", "ref": "r", "tags": ["p"]}, schema) is None
    for value, where in [({"a": 13}, "$.a"), ({"a": 3}, "$.a"), ({"a": 2, "kind": "y", "tags": ["p", "p"]}, "$.tags"),
                         ({"a": 2, "kind": "x"}, "$"), ({"a": 2, "tags": []}, "$"), ({}, "$"),
                         ({"a": 2, "b": 1}, "$"), ({"a": True}, "$.a")]:
        problem = violation(value, schema)
        assert problem is not None and problem.startswith(where + ":"), (value, problem)
    assert "not a finite number" in violation({"a": float("inf")}, {})  # json.loads("1e999")
    assert unenforced(schema) == ["dependentRequired", "if", "not", "then", "uniqueItems"]
    # xgrammar decodes a pattern alone where length bounds are beside it (it logs that it ignores them)
    assert unenforced({"type": "string", "pattern": "^a+$", "minLength": 3, "maxLength": 9}) == [
        "maxLength (beside pattern)", "minLength (beside pattern)"]
    assert violation("aa", {"type": "string", "pattern": "^a+$", "minLength": 3}) is not None


def _query(**kw):
    from docproc.pipeline.queries import Query

    return Query("q", "?", **kw)


def test_an_answer_row_says_ok_schema_violation_truncated_or_parse_error():
    from docproc.pipeline.rows import answer_row

    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 13}}},
                         "required": ["n"]})
    q = _query(type="json", max_tokens=16, schema=schema)
    assert answer_row(q, '{"n": 12}', cut=False, constrained=True) == {"value": '{"n": 12}', "status": "ok",
                                                                        "error": None}
    row = answer_row(q, '{"n": 13}', cut=False, constrained=True)
    assert row["status"] == "schema_violation" and "$.n" in row["error"]
    row = answer_row(q, '{"n": 1', cut=True, constrained=True)
    assert row["status"] == "truncated" and "max_tokens (16)" in row["error"]
    assert answer_row(q, '{"n": 1', cut=True, constrained=False)["status"] == "parse_error"  # free text, cut
    num = _query(type="number")
    assert answer_row(num, "12.50", cut=False, constrained=True)["status"] == "ok"
    # a number or date closed at max_tokens is not kept: it would be one the model did not write
    assert answer_row(num, "12.", cut=True, constrained=True)["error"].endswith("cut short of valid (not a number "
                                                                              "answer: '12.'); raise the query's max_tokens")
    assert answer_row(num, "12.5", cut=True, constrained=True) == {
        "value": None, "status": "truncated", "error": "the answer reached max_tokens (48) and was closed there: a "
        "number cut short is no value (the answer column holds the text); raise the query's max_tokens"}
    assert answer_row(_query(type="date"), "01 APR 1001", cut=True, constrained=True)["value"] is None
    assert answer_row(q, '{"n": 1}', cut=True, constrained=True)["value"] == '{"n": 1}'  # (an object keeps its)
    assert answer_row(_query(type="string"), "Halcyon Sys", cut=True, constrained=True)["value"] == "Halcyon Sys"
    # what Python's json reads but a strict reader does not is no value, with or without a schema
    # (stored, it would be written back as NaN or Infinity, or keep one of two values at random)
    free = _query(type="json")
    for answer, why in [('{"n": 1, "n": 2}', "the key 'n' appears twice"), ('{"n": NaN}', "NaN is not JSON"),
                        ('{"n": {"m": -Infinity}}', "-Infinity is not JSON"),
                        ('{"n": 1e999}', "the number 1e999 is too large for a double")]:
        for query in (q, free):
            row = answer_row(query, answer, cut=False, constrained=True)
            assert row["status"] == "parse_error" and row["value"] is None and why in row["error"], (answer, row)
    assert answer_row(free, 'It is {"n": 1.5e3, "m": [1, 1]}.', cut=False, constrained=True)["value"] == \
        '{"m": [1, 1], "n": 1500.0}'


def test_a_query_set_warns_of_the_keywords_decoding_does_not_enforce(tmp_path):
    q = tmp_path / "q.toml"
    q.write_text('[[query]]\nname = "doc"\nquestion = "?"\ntype = "json"\n'
                 'schema = { type = "array", uniqueItems = true, items = { type = "integer", not = { const = 1 } } }\n'
                 '[[query]]\nname = "plain"\nquestion = "?"\ntype = "json"\nschema = { type = "object" }\n')
    warnings = load_queries(q).warnings
    assert len(warnings) == 1 and "query 'doc'" in warnings[0] and "not, uniqueItems" in warnings[0]
    assert load_queries(None).warnings == []


def test_the_unenforced_list_is_what_the_grammar_leaves_out():
    """Each keyword UNENFORCED names lets a violating answer through xgrammar's grammar (so the
    warning is true), and the keywords left off it are enforced (so it is not noise)."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    cases = {  # keyword: (schema, an answer that breaks it)
        "not": ({"type": "integer", "not": {"const": 1}}, "1"),
        "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
        "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                               "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
        "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "3"),
        "multipleOf": ({"type": "integer", "multipleOf": 5}, "3"),
        "maxProperties": ({"type": "object", "maxProperties": 1}, '{"a": 1, "b": 2}'),
        "minLength": ({"type": "string", "minLength": 3}, '"ab"'),
    }
    from docproc.pipeline.json_schema import UNENFORCED

    for keyword, (schema, answer) in cases.items():
        g = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        assert accepts(g, answer) == (keyword in UNENFORCED), keyword
    # and through the engine's own rewrite of a schema (numbers bounded, strings made strict):
    # what unenforced() names is what the grammar lets through
    from docproc.engine.structured import grammar
    from docproc.sampling_params import StructuredOutputsParams

    more = [({"type": "integer", "multipleOf": 7}, "3"), ({"type": "integer", "multipleOf": 7, "minimum": 0}, "3"),
            ({"type": "number", "multipleOf": 0.5}, "0.3"), ({"type": "string", "format": "email", "maxLength": 5},
                                                            '"abc@example.com"'),
            ({"type": "string", "format": "date", "minLength": 12}, '"2024-01-31"'),
            ({"type": "string", "format": "iri"}, '"not an iri"'),
            ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaa"'), ({"type": "string", "maxLength": 2}, '"abc"'),
            ({"type": "string", "maxLength": 600}, '"%s"' % ("a" * 601))]
    for schema, answer in more:
        named = unenforced(schema)
        assert accepts(grammar(xgr, StructuredOutputsParams(json=schema)), answer) == bool(named), (schema, named)
    assert unenforced(more[1][0]) == ["multipleOf (beside a range)"]
    for schema, named in (({"type": "integer", "multipleOf": 2000}, "multipleOf 2000 (not a whole number from 1 to"),
                          ({"type": "integer", "multipleOf": 2.5}, "multipleOf 2.5"),
                          ({"type": ["integer", "null"], "multipleOf": 3}, "of a type other than integer alone"),
                          ({"type": "string", "maxLength": 600.0}, "maxLength (over 512)")):
        assert any(named in k for k in unenforced(schema)), (schema, unenforced(schema))
    # (what it names does get through)
    assert accepts(grammar(xgr, StructuredOutputsParams(json={"type": "integer", "multipleOf": 2000})), "1")
    # an integer's multipleOf written 5.0 is a whole number; a nullable string's length bounds
    # are the strict pattern (xgrammar's own rule wrote control characters unescaped)
    assert unenforced({"type": "integer", "multipleOf": 5.0}) == []
    nullable = grammar(xgr, StructuredOutputsParams(json={"type": ["string", "null"], "maxLength": 5}))
    assert not accepts(nullable, '"a\x01b"') and accepts(nullable, '"abc"') and accepts(nullable, "null")
    # an unknown format beside a type list keeps its length bounds (they were dropped with nothing said)
    assert not accepts(grammar(xgr, StructuredOutputsParams(json={"type": ["string", "null"], "format": "foo",
                                                                  "maxLength": 3})), '"abcd"')
    assert unenforced(more[3][0]) == ["maxLength (beside format)"] and unenforced(more[5][0]) == ["format 'iri'"]
    assert unenforced({"type": "string", "format": "iri", "maxLength": 3}) == ["format 'iri'"]  # (its length holds)


def test_the_rules_are_bounded_and_dates_real():
    """An amount has at most 18 integer digits; a date rule admits exactly the dates the normaliser
    reads as real ones (a random 7B-geometry model wrote 75/48/4427 under the old rule)."""
    import datetime

    from docproc.engine.structured import max_output_bytes
    from docproc.pipeline.constraints import DATE_PATTERN, PATTERNS, answer_allowed
    from docproc.pipeline.normalize import normalize_date
    from docproc.sampling_params import StructuredOutputsParams

    assert answer_allowed("number", "1" * 18) is None and answer_allowed("number", "1" * 19) is not None
    assert answer_allowed("number", "1,234,567.89") is None
    assert answer_allowed("date", "December " + " " * 5 + "31, 2024") is not None
    rule = re.compile(DATE_PATTERN)
    for y in (2023, 2024, 1900, 2000):
        for m in range(1, 13):
            name = datetime.date(2000, m, 1).strftime("%B")
            for d in range(0, 33):
                for text in (f"{y}-{m:02d}-{d:02d}", f"{d}.{m}.{y}", f"{d}/{m}/{y}", f"{m}/{d}/{y}",
                             f"{name} {d}, {y}", f"{d} {name[:3]} {y}"):
                    assert (rule.fullmatch(text) is not None) == (normalize_date(text) is not None), text
    # the amount and date rules never outgrow the default max_tokens (48): never steered
    assert max_output_bytes(StructuredOutputsParams(regex=PATTERNS["number"])) <= 48
    assert max_output_bytes(StructuredOutputsParams(regex=PATTERNS["date"])) <= 48
    assert max_output_bytes(StructuredOutputsParams(regex=PATTERNS["string"])) is None
    assert max_output_bytes(StructuredOutputsParams(regex="(ab|abcd)?é")) == 6


# ---- the engine: outputs that close within max_tokens -------------------------------------------

BUDGET_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["total", "vendor", "items"],
                 "properties": {"total": {"type": "number"}, "vendor": {"type": "string"},
                                "items": {"type": "array", "items": {"type": "string"}}}}


@pytest.fixture(scope="module")
def llm(qwen2_vl_dir):
    pytest.importorskip("xgrammar")
    from docproc import LLM

    return LLM(str(qwen2_vl_dir), device="cpu")


def test_constrained_outputs_close_within_max_tokens(llm):
    """A random model under a schema of unbounded strings, an array and a number runs to
    past these budgets; each output still parses and validates (steered onto its shortest
    completion as the budget ends), greedy and sampled, from a budget that barely fits the
    shortest answer (24 tokens with this tokenizer) up; and
    numbers stay within the grammar's bounds (no exponent, at most 15 integer digits)."""
    from docproc import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=BUDGET_SCHEMA)
    sps = [SamplingParams(max_tokens=mt, temperature=t, seed=i, structured_outputs=so)
           for mt in (26, 40) for t in (0.0, 1.0) for i in range(2)]
    outs = llm.generate([PROMPT + str(i) for i in range(len(sps))], sps)
    for sp, o in zip(sps, outs):
        text = o.outputs[0].text
        assert len(o.outputs[0].token_ids) <= sp.max_tokens
        value = json.loads(text)
        assert violation(value, BUDGET_SCHEMA) is None, text
        assert "e" not in json.dumps(value["total"]).lower() and abs(value["total"]) < 1e15, text
    # the budget mattered: left to run, the greedy outputs are longer than their budgets
    greedy = [(p, sp) for p, sp in zip(range(len(sps)), sps) if sp.temperature == 0]
    free = llm.generate([PROMPT + str(i) for i, _ in greedy], SamplingParams(max_tokens=48, structured_outputs=so))
    assert all(len(f.outputs[0].token_ids) > sp.max_tokens for f, (_, sp) in zip(free, greedy))
    # closed by the budget, not ended by the model: said so (the pipeline stores them as truncated)
    assert all(outs[i].outputs[0].finish_reason == "length" for i, _ in greedy)


def test_an_output_that_cannot_fit_is_cut_and_reported_truncated(llm):
    """Six required fields cannot be written in 8 tokens: the output is cut (finish_reason
    length), and the pipeline's row for it says truncated."""
    from docproc import SamplingParams, StructuredOutputsParams
    from docproc.pipeline.rows import answer_row

    schema = {"type": "object", "required": list("abcdef"), "additionalProperties": False,
              "properties": {k: {"type": ["string", "null"]} for k in "abcdef"}}
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        json=schema)))[0].outputs[0]
    assert out.finish_reason == "length"
    q = _query(type="json", max_tokens=8, schema=json.dumps(schema))
    assert answer_row(q, out.text, cut=True, constrained=True)["status"] == "truncated"


@pytest.mark.slow
def test_budget_steering_with_a_draft_gives_the_plain_tokens(qwen2_vl_dir, tmp_path_factory, llm):
    """The steering depends on the matcher's state and the tokens generated only: a draft of other
    weights proposing under it, and the target verifying under it, give the tokens of plain
    constrained decoding."""
    from docproc import LLM, SamplingParams, StructuredOutputsParams
    from fixtures.checkpoints import make_model

    other = make_model(tmp_path_factory.mktemp("budget_draft"), "qwen2_vl", seed=3)
    spec = LLM(str(qwen2_vl_dir), device="cpu", speculative_model=str(other), num_speculative_tokens=3)
    so = StructuredOutputsParams(json=BUDGET_SCHEMA)
    sps = [SamplingParams(max_tokens=mt, structured_outputs=so) for mt in (26, 30, 36)]
    prompts = [PROMPT + c for c in "xyz"]
    got = spec.generate(prompts, sps)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in llm.generate(prompts, sps)]
    assert sum(o.metrics.draft_proposed for o in got) > 0
    for o in got:
        assert violation(json.loads(o.outputs[0].text), BUDGET_SCHEMA) is None


def test_bounding_the_rules_keeps_the_fingerprints_of_stored_documents():
    """The bounds on the amount and date rules refuse only answers nothing stored can usefully
    hold, so the default query set keeps the fingerprint its documents were done under (no
    documents redone on upgrade); a query's own regex is fingerprinted as written."""
    from docproc.pipeline.constraints import PATTERNS, RULE_FINGERPRINTS

    assert load_queries(None).fingerprint == "6dbf4745a2a717c1"
    assert RULE_FINGERPRINTS["number"] != PATTERNS["number"] and RULE_FINGERPRINTS["date"] != PATTERNS["date"]
    assert re.fullmatch(RULE_FINGERPRINTS["number"], "1" * 30)  # the first form: unbounded


def test_a_completion_ends_a_character_cut_between_tokens_first(llm):
    """An output that stopped inside a multi-byte character (a random model writes such tokens)
    is completed by the rest of that character's bytes, then the text that closes it."""
    from docproc.engine.structured import GrammarCompiler, tokenizer_size
    from docproc.sampling_params import StructuredOutputsParams

    gc = GrammarCompiler(llm.tokenizer, tokenizer_size(llm.tokenizer), llm.eos_token_ids)
    m = gc.matcher(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}},
                                                 "required": ["a"]}), 64)
    gc.completion(m.matcher, None)  # (compiles: the vocabulary is read)
    first = next(t for t, b in enumerate(gc._vocab) if b == b"\xc3")
    for t in llm.tokenizer.encode('{"a": "', add_special_tokens=False) + [first]:
        assert m.accept_token(t)
    lead, text = gc.completion(m.matcher, m._scan[-1])
    assert len(lead) == 1 and 0x80 <= gc._vocab[lead[0]][0] <= 0xBF and text == '"}'
    for t in lead + gc.encode(text):
        assert m.accept_token(t)
    assert m.is_completed()


def test_the_completion_ends_values_rather_than_growing_them(llm):
    """The shortest completion ends a number where it is (no zeros padded on), closes what is
    open, and takes a repeated character last, so a pattern that needs something after it is
    still completed."""
    from docproc.engine.structured import GrammarCompiler, bounded_numbers, tokenizer_size
    from docproc.sampling_params import StructuredOutputsParams

    gc = GrammarCompiler(llm.tokenizer, tokenizer_size(llm.tokenizer), llm.eos_token_ids)

    def completion(constraint, prefix):
        m = gc.matcher(constraint, 64)
        for t in llm.tokenizer.encode(prefix, add_special_tokens=False):
            assert m.accept_token(t), prefix
        return gc.completion(m.matcher, m._scan[-1] if m._scan is not None else None)

    schema = {"type": "object", "properties": {"total": {"type": "number"}, "vendor": {"type": "string"}},
              "required": ["total", "vendor"], "additionalProperties": False}
    assert completion(StructuredOutputsParams(json=schema), '{"total": 12') == ([], ', "vendor": ""}')
    lead, text = completion(StructuredOutputsParams(regex="[0-9]+-[A-Z]+"), "12")
    assert text in ("-A", "0-A", "00-A")  # a repeat of "0" may never close: it goes last after two
    # a bound the schema gives past the grammar's limit is never contradicted
    big = bounded_numbers({"type": "integer", "minimum": 10**15})
    assert big == {"type": "integer", "minimum": 10**15}
    assert completion(StructuredOutputsParams(json={"type": "integer", "minimum": 10**15}), "1") is not None


def test_an_end_forced_where_the_grammar_takes_nothing_else_is_not_a_truncation(llm):
    """A JSON answer written whole within the budget's last tokens is ended there by the budget,
    as the grammar alone would end it: not steered (finish_reason stop, the row is not truncated).
    A number complete at the same point could go on with more digits: ending it is a cut."""
    from docproc.engine.structured import GrammarCompiler, tokenizer_size
    from docproc.pipeline.constraints import PATTERNS
    from docproc.sampling_params import StructuredOutputsParams

    gc = GrammarCompiler(llm.tokenizer, tokenizer_size(llm.tokenizer), llm.eos_token_ids)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
              "additionalProperties": False}

    def written(constraint, text, left):
        """The matcher after text, written freely, with `left` tokens of its budget left then,
        and the budget's decision there."""
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        m = gc.matcher(constraint, len(ids) + left)
        for t in ids:
            assert m.forced_token() is None and m.accept_token(t)
        return m, m.forced_token()

    from docproc.engine.structured import BudgetMatcher

    left = BudgetMatcher.MARGIN + 1  # (the end is forced from here; its closers were written freely)
    m, forced = written(StructuredOutputsParams(json=schema), '{"a": "a long value here"}', left)
    assert forced in gc.stop_token_ids and m.accept_token(forced) and not m.steered()
    m, forced = written(StructuredOutputsParams(regex=PATTERNS["number"]), "1234.5", left)
    assert forced in gc.stop_token_ids and m.accept_token(forced) and m.steered()
    m, forced = written(StructuredOutputsParams(regex="[0-9]{3}( [0-9]{3})*"), "123", left)  # (goes on after a space)
    assert forced in gc.stop_token_ids and m.accept_token(forced) and m.steered()
    # the bundled tokenizer has no " 1"-like token: after "123" the grammar takes a lone space only,
    # which counts as going on (a whitespace-blind check called this end whole)
    from transformers import AutoTokenizer

    bundled = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parent.parent / "docproc" / "assets" /
                                                "models" / "target"))
    eos = [bundled.convert_tokens_to_ids("<|im_end|>")]
    gcb = GrammarCompiler(bundled, tokenizer_size(bundled), eos)
    ids = bundled.encode("123", add_special_tokens=False)
    mb = gcb.matcher(StructuredOutputsParams(regex="[0-9]{3}( [0-9]{3})*"), len(ids) + left)
    for t in ids:
        assert mb.forced_token() is None and mb.accept_token(t)
    assert gcb.takes_more(mb.matcher)
    forced = mb.forced_token()
    assert forced in gcb.stop_token_ids and mb.accept_token(forced) and mb.steered()
    m, forced = written(StructuredOutputsParams(json=schema), '{"a": "a long value here"}', left + 1)
    assert forced is None


def test_a_forced_token_is_one_the_grammar_takes(llm):
    """Where the tokenizer reads the completion's text otherwise than the grammar does (an enum
    value that is a special token's text), the forced token is the completion's first byte: the
    request ends valid rather than failing on a token outside its constraint."""
    from docproc import SamplingParams, StructuredOutputsParams

    schema = {"type": "object", "properties": {"k": {"enum": ["<|im_end|>", "xx"]}}, "required": ["k"]}
    outs = llm.generate([PROMPT + str(i) for i in range(4)],
                        [SamplingParams(max_tokens=mt, structured_outputs=StructuredOutputsParams(json=schema))
                         for mt in (8, 10, 12, 16)])
    for o in outs:
        assert o.error is None and o.outputs[0].finish_reason in ("stop", "length"), o.outputs[0].stop_reason
    for o in outs[2:]:  # (8 and 10 tokens cannot hold '{"k": "<|im_end|>"}' once begun, a byte a token)
        assert json.loads(o.outputs[0].text)["k"] in ("<|im_end|>", "xx"), o.outputs[0].text


def test_the_grammar_rewrites_read_keywords_not_property_names_or_data(capfd):
    """What the grammar is given: number bounds and strict strings go to subschemas, wherever they
    are; a property named like a keyword (enum, pattern, minLength) is a property, and const /
    enum values are data, left as written. A pattern with length bounds is given alone (xgrammar
    ignores the bounds and logged so on stderr, whatever --quiet said; they are validated after)."""
    from docproc.engine.structured import _patterns, _strict_strings, bounded_numbers, compile_problem
    from docproc.sampling_params import StructuredOutputsParams

    data = {"type": "string", "maxLength": 3, "pattern": "(", "minimum": 0}
    schema = {"type": "object", "required": ["enum", "pattern"], "properties": {
        "enum": {"type": "number"}, "pattern": {"type": "string", "maxLength": 4},
        "minLength": {"type": "string", "pattern": "^[A-Z]+$", "minLength": 2},
        "c": {"const": data, "enum": [data], "default": data}}}
    bounded = bounded_numbers(schema)
    assert bounded["properties"]["enum"]["maximum"] == 10**15 - 1 and bounded["properties"]["c"]["const"] == data
    strict = _strict_strings(schema)["properties"]
    assert strict["pattern"]["pattern"].endswith("{0,4}$") and "maxLength" not in strict["pattern"]
    assert strict["minLength"] == {"type": "string", "pattern": "^[A-Z]+$"}
    assert strict["c"] == {"const": data, "enum": [data], "default": data}
    assert sorted(_patterns(schema)) == ["^[A-Z]+$"]  # (not the const's "(")
    capfd.readouterr()
    assert compile_problem(StructuredOutputsParams(json=json.dumps(schema))) is None
    assert "ignoring minLength" not in capfd.readouterr().err
    assert schema["properties"]["minLength"]["minLength"] == 2  # (the query's schema itself is not changed)


@pytest.mark.slow
def test_a_schemas_date_format_admits_exactly_the_real_dates_the_validator_accepts():

    from docproc.engine.structured import _strict_strings, compile_problem
    from docproc.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]}
    pattern = re.compile(_strict_strings(schema)["properties"]["d"]["pattern"])
    assert compile_problem(StructuredOutputsParams(json=json.dumps(schema))) is None
    for y in [*range(1996, 2030), 1200, 1600, 1700, 1900, 2000, 2100, 2400]:
        for m in range(1, 13):
            for d in range(1, 32):
                text = f"{y:04d}-{m:02d}-{d:02d}"
                real = violation({"d": text}, schema) is None  # the validator's date format
                assert bool(pattern.fullmatch(text)) == real, text


@pytest.mark.slow
def test_a_model_that_keeps_opening_elements_is_still_closed_within_its_budget(llm):
    """An adversary that opens a new array element whenever the grammar lets it (a `,` before
    an element of objects whose fields are required costs all of them at once): for every budget
    from the shortest answer's up, the output still parses and validates."""
    import xgrammar as xgr

    from docproc.engine.structured import GrammarCompiler, tokenizer_size
    from docproc.sampling_params import StructuredOutputsParams

    gc = GrammarCompiler(llm.tokenizer, tokenizer_size(llm.tokenizer), llm.eos_token_ids)
    schema = {"type": "object", "required": ["lines"], "additionalProperties": False, "properties": {
        "lines": {"type": "array", "items": {"type": "object", "required": ["amount", "code"],
                                             "additionalProperties": False, "properties": {
                                                 "amount": {"type": "integer"}, "code": {"type": "string"}}}}}}
    so = StructuredOutputsParams(json=schema)
    prefer = [",", "{", "[", '"', "7", "a", "}", "]"]
    for budget in range(24, 72, 3):
        m = gc.matcher(so, budget)
        text = ""
        for _ in range(budget):
            if m.is_terminated():
                break
            mask = xgr.allocate_token_bitmask(1, gc.num_tokens)
            m.fill_next_token_bitmask(mask, 0)
            allowed = [t for t in range(gc.num_tokens) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
            pick = next((t for ch in prefer for t in allowed if gc.token_text(t) == ch), allowed[0])
            assert m.accept_token(pick)
            text += gc.token_text(pick)
        value = json.loads(text.removesuffix("<|im_end|>"))  # (an end token the budget may force)
        assert violation(value, schema) is None, (budget, text)



def _walk(gc, so, budget: int, seed: int) -> tuple[list[int], list]:
    """A model that takes a random token the mask allows (seeded), or the token the budget forces:
    its tokens, and the budget's decision at each position (a token, or None)."""
    import random

    import xgrammar as xgr

    rng = random.Random(seed)
    m = gc.matcher(so, budget)
    mask = xgr.allocate_token_bitmask(1, gc.num_tokens)
    tokens, decisions = [], []
    while len(tokens) < budget and not m.is_terminated():
        forced = m.forced_token()
        decisions.append(forced)
        if forced is None:
            m.matcher.fill_next_token_bitmask(mask, 0)
            forced = rng.choice([t for t in range(gc.num_tokens) if (int(mask[0, t // 32]) >> (t % 32)) & 1])
        assert m.accept_token(forced)
        tokens.append(forced)
    return tokens, decisions


def test_a_closing_answer_walks_the_grammar_once_and_every_path_decides_alike(llm):
    """Once the budget forces a completion that takes the rest of the budget, the next positions
    take its tokens without walking the grammar again; a position reached with the ones before it
    undecided (tokens accepted without a mask, as after a verification) gets the decision it gets
    asked in turn."""
    from docproc.engine.structured import GrammarCompiler, tokenizer_size
    from docproc.pipeline.queries import load_queries

    gc = GrammarCompiler(llm.tokenizer, tokenizer_size(llm.tokenizer), llm.eos_token_ids)
    so = next(q for q in load_queries(None).queries if q.name == "all_fields").structured_outputs()
    walks = 0
    real = gc.completion

    def counted(*a, **k):
        nonlocal walks
        walks += 1
        return real(*a, **k)

    following = 0
    for seed in range(6):
        tokens, decisions = _walk(gc, so, 64, seed)
        assert decisions[-1] is not None, decisions  # (a random walk is closed by the budget)
        gc.completion = counted
        try:
            m = gc.matcher(so, 64)
            for n, t in enumerate(tokens):
                walks = 0
                assert m.forced_token() == decisions[n]
                _, plan, i = m._path[n - 1] if n else (None, (), 0)
                if decisions[n - 1] == tokens[n - 1] is not None and i < len(plan) and not m.is_completed() \
                        and len(plan) - i + m.MARGIN >= 64 - n:  # the forced completion takes the rest
                    # its next token, with no walk (but a checkpoint's, every CHECK_EVERY tokens)
                    assert walks == (n % m.CHECK_EVERY == 0) and decisions[n] == plan[i], (seed, n, walks)
                    following += 1
                assert m.accept_token(t)
        finally:
            gc.completion = real
        # two tokenizations of a completion in turn (the tokenizer's, then byte by byte): a position
        # that walked afresh, rather than took the rest of the completion forced before it, shows
        calls = 0

        def alternating(text: str) -> list[int]:
            nonlocal calls
            calls += 1
            return real_encode(text) if calls % 2 else [gc.byte_token(b) for b in text.encode()]

        real_encode, gc.encode = gc.encode, alternating
        try:
            tokens, decisions = _walk(gc, so, 64, seed)
            for ask in (lambda n: n % 3 == 2, lambda n: n == len(tokens) - 1, lambda n: n % 2 or n > 40):
                calls, m = 0, gc.matcher(so, 64)
                for n, t in enumerate(tokens):
                    if ask(n):
                        assert m.forced_token() == decisions[n], (seed, n)
                    assert m.accept_token(t)
        finally:
            gc.encode = real_encode
    assert following > 20
    # a decision that raises while the positions before are decided leaves the matcher where it was
    m = gc.matcher(so, 64)
    for t in tokens[:-1]:
        assert m.accept_token(t)

    def broken(*a, **k):
        raise RuntimeError("walk failed")

    gc.completion = broken
    try:
        with pytest.raises(RuntimeError, match="walk failed"):
            m.forced_token()
    finally:
        gc.completion = real
    assert m.num_accepted == len(tokens) - 1 and m._tokens == tokens[:-1] and m.accept_token(tokens[-1])
