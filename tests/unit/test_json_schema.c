/* test_json_schema.c - the JSON Schema and regex compilers (tandem/json_schema.h): for each
 * keyword, concrete JSON texts the compiled grammar must accept and reject (run through the
 * grammar engine's matcher byte by byte), and the refusals with their JSON pointers. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tdm_test.h"
#include "tandem/grammar.h"
#include "tandem/json_schema.h"

/* Compiles schema (fails the test on error) and parses the GBNF. */
static tdm_grammar_t *compile(const char *schema)
{
    tdm_buf_t out = TDM_BUF_INIT;
    tdm_error_t err;
    int rc = tdm_json_schema_to_gbnf(schema, strlen(schema), &out, &err);
    if (rc != 0)
        fail_msg("schema %s: %s", schema, err.msg);
    tdm_grammar_t *g = tdm_grammar_parse(out.data, out.len, NULL, &err);
    if (!g)
        fail_msg("schema %s: GBNF does not parse: %s\n%s", schema, err.msg, out.data);
    tdm_buf_free(&out);
    return g;
}

static bool grammar_accepts(const tdm_grammar_t *g, const char *text)
{
    tdm_error_t err;
    tdm_grammar_matcher_t *m = tdm_grammar_matcher_new(g, NULL, &err);
    assert_non_null(m);
    bool ok = tdm_grammar_matcher_accept_bytes(m, text, strlen(text)) &&
              tdm_grammar_matcher_is_accepting(m);
    tdm_grammar_matcher_destroy(&m);
    return ok;
}

/* Checks each text of the NULL-terminated lists against schema. */
static void check(const char *schema, const char *const *good, const char *const *bad)
{
    tdm_grammar_t *g = compile(schema);
    for (; good && *good; good++)
        if (!grammar_accepts(g, *good))
            fail_msg("schema %s should accept %s", schema, *good);
    for (; bad && *bad; bad++)
        if (grammar_accepts(g, *bad))
            fail_msg("schema %s should reject %s", schema, *bad);
    tdm_grammar_destroy(&g);
}

#define GOOD(...) ((const char *const[]){__VA_ARGS__, NULL})
#define BAD(...) ((const char *const[]){__VA_ARGS__, NULL})

/* A copy of text with every ' turned into " (caller frees), so schemas read as JSON. */
static char *dq(const char *text)
{
    char *s = strdup(text);
    assert_non_null(s);
    for (char *p = s; *p; p++)
        if (*p == '\'')
            *p = '"';
    return s;
}

/* check() with ' for " in the schema and in every text. */
static void check_q(const char *schema, const char *const *good, const char *const *bad)
{
    char *s = dq(schema);
    tdm_grammar_t *g = compile(s);
    for (; good && *good; good++) {
        char *t = dq(*good);
        if (!grammar_accepts(g, t))
            fail_msg("schema %s should accept %s", s, t);
        free(t);
    }
    for (; bad && *bad; bad++) {
        char *t = dq(*bad);
        if (grammar_accepts(g, t))
            fail_msg("schema %s should reject %s", s, t);
        free(t);
    }
    tdm_grammar_destroy(&g);
    free(s);
}

/* The schema is refused with exactly this message. */
static void refused(const char *schema, const char *msg)
{
    tdm_buf_t out = TDM_BUF_INIT;
    tdm_error_t err;
    int rc = tdm_json_schema_to_gbnf(schema, strlen(schema), &out, &err);
    if (rc != TDM_EINVALID)
        fail_msg("schema %s: expected a refusal, got %d:\n%s", schema, rc, out.data);
    assert_string_equal(err.msg, msg);
    assert_true(out.len == 0); /* nothing half-written */
    tdm_buf_free(&out);
}

static void test_types(void **state)
{
    (void)state;
    check("{\"type\":\"string\"}", GOOD("\"\"", "\"a b\"", "\"\\u00e9\\n\\\"\"", "\"\xc3\xa9\""),
          BAD("1", "\"a", "\"\n\"", "null"));
    check("{\"type\":\"integer\"}", GOOD("0", "-12", "123456789012"), BAD("01", "1.5", "-", "1e3"));
    check("{\"type\":\"number\"}", GOOD("0", "-1.5", "2e10", "3.25E-2"), BAD("1.", ".5", "+1"));
    check("{\"type\":\"boolean\"}", GOOD("true", "false"), BAD("1", "True"));
    check("{\"type\":\"null\"}", GOOD("null"), BAD("0"));
    check("{\"type\":[\"string\",\"null\"]}", GOOD("\"x\"", "null"), BAD("1"));
    check("{\"type\":[\"integer\",\"number\"]}", GOOD("1", "1.5"), BAD("\"1\""));
    check("{}", GOOD("1", "{\"a\":[1,{\"b\":null}]}", "\"s\"", "[]"), BAD("{", "[1,]"));
    check("true", GOOD("[true]"), BAD("tru"));
    /* no type: every type, with the keywords of each */
    check("{\"minLength\":2}", GOOD("\"ab\"", "1", "null"), BAD("\"a\""));
    /* a type no value of which fits is left out, the others stay */
    check_q("{'allOf':[{'minimum':2},{'maximum':0}]}",
            GOOD("true", "null", "'s'", "{'a':1}", "[1,2]"), BAD("0", "1", "2", "-1", "1.5"));
    check_q("{'type':['integer','string'],'minimum':2,'maximum':0}", GOOD("'x'"), BAD("1"));
    check_q("{'type':['string','array'],'minLength':3,'maxLength':1,'minItems':1}", GOOD("[1]"),
            BAD("'abc'", "''", "[]"));
    refused("{\"type\":[\"integer\",\"string\"],\"minimum\":2,\"maximum\":0,\"pattern\":\"a^\"}",
            "/minimum: no integer within the bounds");
    refused("{\"type\":\"integer\",\"allOf\":[{\"minimum\":2},{\"maximum\":0}]}",
            "/allOf/minimum: no integer within the bounds");
}

static void test_whitespace(void **state)
{
    (void)state;
    const char *s = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"array\"}}}";
    check(s, GOOD("{\"a\":[1,2]}", "{ \"a\" : [ 1 , 2 ] }", "{\n  \"a\": [\n    1,\n    2\n  ]\n}"),
          BAD(" {\"a\":[]}", "{\"a\":[]} ", "{  \"a\":[]}", "{\n                      \"a\":[]}"));
}

static void test_properties_required_order(void **state)
{
    (void)state;
    const char *s = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},"
                    "\"b\":{\"type\":\"string\"},\"c\":{\"type\":\"boolean\"}},"
                    "\"required\":[\"b\"],\"additionalProperties\":false}";
    check(s,
          GOOD("{\"b\":\"x\"}", "{\"a\":1,\"b\":\"x\"}", "{\"a\":1,\"b\":\"x\",\"c\":true}",
               "{\"b\":\"x\",\"c\":false}"),
          BAD("{}", "{\"a\":1}", "{\"b\":1}", "{\"b\":\"x\",\"d\":1}", "{\"a\":1,,\"b\":\"x\"}",
              "{\"b\":\"x\",}", "{\"b\":\"x\",\"b\":\"y\"}", "{\"a\":1,\"b\":\"x\",\"a\":2}"));
    /* up to four defined properties in any order (each once), the additional ones after them */
    check_q("{'properties':{'a':{'type':'integer'},'b':{'type':'string'},'c':{}},'required':['b']}",
            GOOD("{'b':'x','a':1}", "{'c':0,'b':'x','a':1}", "{'c':0,'a':1,'b':'x','z':2}",
                 "{'b':'x','z':1}"),
            BAD("{'a':1,'c':0}", "{'b':'x','a':1,'b':'y'}", "{'b':'x','z':1,'a':1}",
                "{'b':'x','a':'s'}"));
    /* five or more: the definition order */
    check_q("{'properties':{'a':{},'b':{},'c':{},'d':{},'e':{}},'required':['b']}",
            GOOD("{'a':1,'b':2,'e':3}", "{'b':2}"), BAD("{'b':2,'a':1}", "{'e':1,'b':2}"));
}

static void test_additional_properties(void **state)
{
    (void)state;
    /* default true: any other key after the defined ones, never a defined one again */
    const char *s = "{\"type\":\"object\",\"properties\":{\"ab\":{\"type\":\"integer\"}}}";
    check(s,
          GOOD("{}", "{\"ab\":1}", "{\"ab\":1,\"x\":[1]}", "{\"a\":\"s\",\"abc\":2,\"b\":null}",
               "{\"\":1}"),
          BAD("{\"ab\":\"s\"}", "{\"x\":1,\"ab\":\"s\"}", "{\"ab\":1,\"ab\":2}"));
    const char *t = "{\"type\":\"object\",\"additionalProperties\":{\"type\":\"integer\"}}";
    check(t, GOOD("{}", "{\"a\":1,\"b\":2}"), BAD("{\"a\":\"x\"}"));
    const char *u = "{\"type\":\"object\",\"properties\":{\"a\":{}},\"required\":[\"z\"],"
                    "\"additionalProperties\":{\"type\":\"string\"}}";
    check(u, GOOD("{\"z\":\"s\"}", "{\"a\":1,\"z\":\"s\",\"q\":\"t\"}"),
          BAD("{\"a\":1}", "{\"z\":1}"));
    refused("{\"type\":\"object\",\"required\":[\"z\"],\"additionalProperties\":false}",
            "/required: 'z' is not in properties and additionalProperties is false");
    check("{\"type\":\"object\",\"properties\":{\"a\":false}}", GOOD("{\"b\":1}"),
          BAD("{\"a\":1}"));
    /* minProperties 1: at least one member */
    check("{\"type\":\"object\",\"minProperties\":1}", GOOD("{\"x\":1}"), BAD("{}"));
    check("{\"type\":\"object\",\"properties\":{\"a\":{}},\"additionalProperties\":false,"
          "\"minProperties\":1}",
          GOOD("{\"a\":1}"), BAD("{}"));
    /* counts: a rule per defined property and members so far, optional ones counted */
    check_q("{'type':'object','properties':{'a':{},'b':{},'c':{}},'additionalProperties':false,"
            "'minProperties':2}",
            GOOD("{'a':1,'b':2}", "{'b':1,'c':2}", "{'a':1,'b':2,'c':3}"),
            BAD("{}", "{'a':1}", "{'c':1}"));
    check_q("{'type':'object','properties':{'a':{},'b':{}},'required':['a'],'maxProperties':2}",
            GOOD("{'a':1}", "{'a':1,'b':2}", "{'a':1,'x':2}"),
            BAD("{'a':1,'b':2,'x':3}", "{'a':1,'x':2,'y':3}", "{'b':1}"));
    check_q("{'properties':{'n':{'type':'string'}},'required':['n'],'minProperties':2,"
            "'maxProperties':3,'additionalProperties':{'type':'integer'}}",
            GOOD("{'n':'a','x':1}", "{'n':'a','x':1,'y':2}", "5", "[]"),
            BAD("{'n':'a'}", "{'n':'a','x':1,'y':2,'z':3}", "{'n':'a','x':'s'}"));
    check_q("{'maxProperties':0}", GOOD("{}", "1"), BAD("{'a':1}"));
    /* in an allOf, the smaller maximum */
    check_q("{'allOf':[{'maxProperties':3},{'maxProperties':1}]}", GOOD("{'a':1}"),
            BAD("{'a':1,'b':2}"));
    refused("{\"type\":\"object\",\"minProperties\":2}",
            "/minProperties: not supported: 2 members where 0 properties are required and the "
            "others may be additional ones (a key written twice would count twice)");
    refused("{\"type\":\"object\",\"minProperties\":3,\"maxProperties\":2}",
            "/minProperties: greater than maxProperties");
    refused("{\"type\":\"object\",\"properties\":{\"a\":{}},\"additionalProperties\":false,"
            "\"minProperties\":2}",
            "/minProperties: no object has a member count in range");
    refused("{\"type\":\"object\",\"maxProperties\":5000}",
            "/maxProperties: not supported: counting 5000 members over 0 properties needs over "
            "4096 rules");
    /* an optional property no value fits is left out; a required one leaves no object, and
     * without `type` the other types are still allowed (required and properties apply to
     * objects only) */
    check("{\"properties\":{\"a\":{\"type\":\"object\",\"enum\":[\"x\"]},\"b\":{}}}",
          GOOD("{\"b\":1}", "{}"), BAD("{\"a\":\"x\"}", "{\"a\":{}}"));
    check_q("{'properties':{'a':{'type':'object','enum':['x']}},'required':['a']}",
            GOOD("1", "'s'", "[]", "null", "true"), BAD("{}", "{'a':'x'}", "{'a':{}}"));
    refused("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"object\",\"enum\":[\"x\"]}},"
            "\"required\":[\"a\"]}",
            "/properties/a/enum: no value allowed (type, enum and const)");
    check_q("{'properties':{'a':false},'required':['a']}", GOOD("[1]", "2"), BAD("{}", "{'a':1}"));
    refused("{\"type\":\"object\",\"properties\":{\"a\":false},\"required\":[\"a\"]}",
            "/properties/a: required but the schema false allows no value");
    /* additionalProperties no value fits: as false */
    check_q("{'type':'object','properties':{'a':{}},'additionalProperties':{'type':'string',"
            "'minLength':2,'maxLength':1}}",
            GOOD("{}", "{'a':1}"), BAD("{'b':'x'}", "{'a':1,'b':1}"));
    check_q("{'type':'object','patternProperties':{'^x':{'type':'integer'}},"
            "'additionalProperties':{'type':'string','minLength':2,'maxLength':1}}",
            GOOD("{}", "{'x1':1}"), BAD("{'y':'ab'}", "{'x1':'a'}"));
}

/* patternProperties: beside additionalProperties false with one schema for every pattern, the
 * other keys must match a pattern; patterns whose schemas accept everything, beside
 * additionalProperties true, constrain nothing; the rest is refused with the pointer. */
static void test_pattern_properties(void **state)
{
    (void)state;
    check_q("{'type':'object','properties':{'id':{'type':'integer'}},'required':['id'],"
            "'patternProperties':{'^x-':{'type':'string'}},'additionalProperties':false}",
            GOOD("{'id':1}", "{'id':1,'x-a':'s'}", "{'id':1,'x-':'s','x-b':'t'}"),
            BAD("{'id':1,'y':'s'}", "{'id':1,'x-a':1}", "{'x-a':'s'}", "{'id':1,'ax-':'s'}"));
    /* two patterns, one schema; unanchored patterns search; an empty object */
    check_q("{'patternProperties':{'^[0-9]+$':{'type':'number'},'_id':{'type':'number'}},"
            "'additionalProperties':false}",
            GOOD("{}", "{'12':1}", "{'a_idb':2.5,'7':0}"), BAD("{'1a':1}", "{'12':'x'}"));
    /* a required name that properties does not define, matched by a pattern */
    check_q("{'required':['x-k'],'patternProperties':{'^x-':{}},'additionalProperties':false}",
            GOOD("{'x-k':1}", "{'x-k':1,'x-j':[]}"), BAD("{}", "{'x-k':1,'y':2}"));
    /* patterns that accept everything constrain nothing */
    check_q("{'patternProperties':{'^a':true},'properties':{'b':{'type':'string'}}}",
            GOOD("{'b':'s','a1':1,'z':2}"), BAD("{'b':1}"));
    /* beside additionalProperties absent: keys matching no pattern take any value */
    check_q("{'patternProperties':{'^a':{'type':'string'}}}",
            GOOD("{}", "{'ab':'x','b':1}", "{'b':1,'a':''}", "{'ba':[1]}"),
            BAD("{'ab':1}", "{'b':1,'a':null}"));
    /* patterns with different schemas; a key matching two satisfies both */
    check_q("{'patternProperties':{'^a':{'type':'integer'},'b$':{'minimum':5}},"
            "'additionalProperties':false}",
            GOOD("{'ab':7,'a':1,'b':5.5}", "{'axb':5}"),
            BAD("{'ab':3}", "{'ab':7.5}", "{'b':4}", "{'c':1}", "{'a':'s'}"));
    /* a defined name matching a pattern: its value satisfies both schemas */
    check_q("{'properties':{'ab':{'type':'integer'}},'patternProperties':{'^a':{'minimum':3}},"
            "'additionalProperties':false}",
            GOOD("{'ab':3}", "{'ab':3,'ac':4.5}", "{}"),
            BAD("{'ab':2}", "{'ab':'x'}", "{'x':1}", "{'ac':1}"));
    /* additionalProperties a schema: only for keys that match no pattern and no name */
    check_q("{'properties':{'id':{}},'patternProperties':{'^x':{'type':'string'}},"
            "'additionalProperties':{'type':'integer'}}",
            GOOD("{'id':'q','xa':'s','y':1}", "{'id':[],'y':2}", "{'x':''}"),
            BAD("{'y':'s'}", "{'xa':1}", "{'id':1,'idx':'s'}"));
    /* every pattern accepting everything, additionalProperties false: only matching keys */
    check_q("{'patternProperties':{'^[a-z]+$':true},'additionalProperties':false}",
            GOOD("{'ab':[1,{}],'c':null}"), BAD("{'A':1}", "{'':1}"));
    /* a pattern's schema false: keys matching it cannot appear */
    check_q("{'patternProperties':{'^_':false},'additionalProperties':{'type':'string'}}",
            GOOD("{'a':'x'}"), BAD("{'_a':'x'}", "{'a':1}"));
    /* a required name that no pattern matches, beside additionalProperties false: no object
     * (the other types are still allowed) */
    check_q("{'required':['b'],'patternProperties':{'^a':{}},'additionalProperties':false}",
            GOOD("1", "'b'", "[]"), BAD("{}", "{'b':1}", "{'a':1}"));
    refused("{\"type\":\"object\",\"required\":[\"b\"],\"patternProperties\":{\"^a\":{}},"
            "\"additionalProperties\":false}",
            "/required: 'b' is not in properties and additionalProperties is false");
    refused("{\"patternProperties\":{\"(?=a)\":{\"type\":\"string\"}}}",
            "/patternProperties/(?=a): group kind not supported (lookahead, flags, ...) (at "
            "offset 2)");
    refused("{\"allOf\":[{\"patternProperties\":{\"^a\":{}},\"additionalProperties\":false},"
            "{\"properties\":{\"b\":{}}}]}",
            "/allOf/1: allOf: patternProperties cannot be merged with properties");
}

static void test_arrays(void **state)
{
    (void)state;
    check("{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":1,\"maxItems\":3}",
          GOOD("[1]", "[1,2,3]", "[ 1 , 2 ]"), BAD("[]", "[1,2,3,4]", "[\"a\"]", "[1,]"));
    check("{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\"},{\"type\":\"integer\"}],"
          "\"items\":false}",
          GOOD("[]", "[\"a\"]", "[\"a\",1]"), BAD("[1]", "[\"a\",1,2]"));
    check(
        "{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\"}],\"items\":{\"type\":\"null\"},"
        "\"minItems\":2}",
        GOOD("[\"a\",null]", "[\"a\",null,null]"), BAD("[\"a\"]", "[\"a\",1]"));
    /* draft-4 tuples */
    check("{\"items\":[{\"type\":\"integer\"}],\"additionalItems\":false}", GOOD("[1]", "[]"),
          BAD("[1,2]"));
    check("{\"type\":\"array\",\"maxItems\":0}", GOOD("[]"), BAD("[1]"));
    /* a position no item fits: the arrays end before it */
    check_q("{'type':'array','prefixItems':[{'type':'integer'},{'type':'string','enum':[1]}]}",
            GOOD("[]", "[1]"), BAD("[1,'x']", "[1,1]", "['x']"));
    check_q("{'type':'array','prefixItems':[{}],'items':{'type':'string','minLength':2,"
            "'maxLength':1}}",
            GOOD("[]", "[1]"), BAD("[1,'x']", "[1,1]"));
    refused("{\"type\":\"array\",\"prefixItems\":[{},false],\"minItems\":2}",
            "/minItems: more items than the schema allows");
}

static void test_enum_const(void **state)
{
    (void)state;
    /* the values are checked against the keywords beside them that apply to their type */
    check_q("{'enum':['a','bb',1,5],'minLength':2,'minimum':2}", GOOD("'bb'", "5"),
            BAD("'a'", "1"));
    check_q("{'enum':[[1],[1,2],{'a':1},{}],'minItems':2,'required':['a']}",
            GOOD("[1,2]", "{'a':1}"), BAD("[1]", "{}"));
    check_q("{'enum':[1,2,3],'minimum':1,'exclusiveMinimum':true,'multipleOf':3}", GOOD("3"),
            BAD("1", "2"));
    refused("{\"const\":\"x\",\"maxLength\":0}", "/const: no value allowed (type, enum and const)");
    refused("{\"enum\":[\"a\",\"bb\"],\"pattern\":\"b\"}",
            "/pattern: not supported beside enum / const (values not checked against it)");
    check("{\"enum\":[\"a\\\"b\",1,2.5,null,[1,{\"k\":true}],1e-05]}",
          GOOD("\"a\\\"b\"", "1", "1.0", "2.5", "null", "[1,{\"k\":true}]", "[ 1, {\"k\": true} ]",
               "1e-05"),
          BAD("\"a\"", "2", "[1]", "true", "0.00001"));
    check("{\"const\":\"x\"}", GOOD("\"x\""), BAD("\"y\""));
    check("{\"type\":\"string\",\"enum\":[\"a\",1]}", GOOD("\"a\""), BAD("1"));
    check("{\"const\":1e+16}", GOOD("1e+16", "10000000000000000"), BAD("1"));
    refused("{\"type\":\"string\",\"enum\":[1]}", "/enum: no value allowed (type, enum and const)");
}

/* Large enums compile into a trie: 1,554 strings (more than the engine's 1,024 parse stacks
 * a flat alternation would start at once), each accepted, non-members refused. */
static void test_enum_trie(void **state)
{
    (void)state;
    enum { N = 1554 };
    tdm_buf_t schema = TDM_BUF_INIT, v = TDM_BUF_INIT;
    tdm_buf_puts(&schema, "{\"enum\":[");
    for (int i = 0; i < N; i++) /* shared prefixes, values that prefix others, UTF-8 */
        tdm_buf_printf(&schema, "%s\"%s%d\"", i ? "," : "",
                       i % 3 == 0   ? "item-"
                       : i % 3 == 1 ? "it\u00e9m/"
                                    : "it\u00e8m",
                       i / 3);
    tdm_buf_puts(&schema, ",\"\",\"it\",7,2.5,true,null,{\"a\":[1]}]}");
    assert_false(schema.oom);
    tdm_grammar_t *g = compile(schema.data);
    for (int i = 0; i < N; i++) {
        tdm_buf_clear(&v);
        tdm_buf_printf(&v, "\"%s%d\"",
                       i % 3 == 0   ? "item-"
                       : i % 3 == 1 ? "it\xc3\xa9m/"
                                    : "it\xc3\xa8m",
                       i / 3);
        if (!grammar_accepts(g, v.data))
            fail_msg("enum value %s rejected", v.data);
    }
    const char *good[] = {"\"\"", "\"it\"", "7", "7.0", "2.5", "true", "null", "{\"a\":[1]}"};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++)
        if (!grammar_accepts(g, good[i]))
            fail_msg("enum value %s rejected", good[i]);
    const char *bad[] = {"\"item-518\"", "\"item-\"", "\"item-00\"", "\"ite\"", "\"it\xc3\xaam1\"",
                         "\"item-1x\"",  "\"i\"",     "8",           "false",   "{\"a\":[]}"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        if (grammar_accepts(g, bad[i]))
            fail_msg("non-member %s accepted", bad[i]);
    tdm_grammar_destroy(&g);
    /* a chain of prefixes deeper than the trie's nesting: "a", "aa", ... 100 of them */
    tdm_buf_clear(&schema);
    tdm_buf_puts(&schema, "{\"enum\":[");
    for (int i = 1; i <= 100; i++)
        tdm_buf_printf(&schema, "%s\"%.*s\"", i > 1 ? "," : "", i,
                       "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                       "aaaaaaaaaaaaaaaaaaaaaaaaaaa");
    tdm_buf_puts(&schema, "]}");
    g = compile(schema.data);
    for (int i = 0; i <= 101; i++) {
        tdm_buf_clear(&v);
        tdm_buf_printf(&v, "\"%.*s\"", i,
                       "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                       "aaaaaaaaaaaaaaaaaaaaaaaaaaaa");
        if (grammar_accepts(g, v.data) != (i >= 1 && i <= 100))
            fail_msg("chain enum misjudges %s", v.data);
    }
    tdm_grammar_destroy(&g);
    tdm_buf_free(&schema);
    tdm_buf_free(&v);
}

static void test_any_one_all_of(void **state)
{
    (void)state;
    check("{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"null\"}]}", GOOD("1", "null"),
          BAD("\"a\""));
    /* oneOf: as anyOf when the branches are disjoint (types, values, a discriminator) */
    check("{\"oneOf\":[{\"type\":\"integer\"},{\"type\":\"string\"}]}", GOOD("1", "\"a\""),
          BAD("null"));
    check("{\"oneOf\":[{\"enum\":[1,2]},{\"const\":3}]}", GOOD("1", "3"), BAD("4"));
    check("{\"type\":\"object\",\"oneOf\":[{\"properties\":{\"k\":{\"const\":\"a\"},\"x\":{}},"
          "\"required\":[\"k\"]},{\"properties\":{\"k\":{\"const\":\"b\"}},\"required\":[\"k\"]}]}",
          GOOD("{\"k\":\"a\",\"x\":1}", "{\"k\":\"b\"}"), BAD("{\"k\":\"c\"}", "{}"));
    /* overlapping branches: each with the complements of the others (exactly one matches) */
    check_q("{'properties':{'a':{},'b':{}},'oneOf':[{'required':['a']},{'required':['b']}]}",
            GOOD("{'a':1}", "{'b':1}"), BAD("{}", "{'a':1,'b':2}", "1"));
    check_q("{'oneOf':[{'type':'object','properties':{'radius':{'type':'number'}},"
            "'required':['radius']},{'type':'object','properties':{'length':{'type':'number'},"
            "'width':{'type':'number'}},'required':['length','width']}]}",
            GOOD("{'radius':1}", "{'length':1,'width':2}", "{'radius':1,'length':2}",
                 "{'radius':1,'length':'x','width':2}"),
            BAD("{'radius':1,'length':2,'width':3}", "{}", "{'radius':'x'}"));
    /* closed objects that require a name the other does not define: disjoint, as anyOf */
    check_q("{'oneOf':[{'type':'object','properties':{'a':{}},'required':['a'],"
            "'additionalProperties':false},{'type':'object','properties':{'b':{}},'required':['b'],"
            "'additionalProperties':false}]}",
            GOOD("{'a':1}", "{'b':[2]}"), BAD("{'a':1,'b':2}", "{}", "1"));
    check_q("{'oneOf':[{'type':'string'},{'type':'string','maxLength':2}]}", GOOD("'abc'"),
            BAD("'ab'", "1"));
    check_q("{'type':'integer','oneOf':[{'minimum':0},{'maximum':10}]}", GOOD("-1", "11"),
            BAD("5", "0", "10"));
    refused("{\"oneOf\":[{\"type\":\"number\"},{\"type\":\"integer\"}]}",
            "/oneOf/0/not: not supported: 'integer' excluded from 'number'");
    /* siblings merge into each branch */
    check("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{}},"
          "\"anyOf\":[{\"required\":[\"a\"]},{\"required\":[\"b\"]}]}",
          GOOD("{\"a\":1}", "{\"b\":2}"), BAD("{}"));
    check("{\"allOf\":[{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},"
          "\"required\":[\"a\"]},{\"properties\":{\"b\":{\"type\":\"string\"}},\"required\":[\"b\"]"
          "}]}",
          GOOD("{\"a\":1,\"b\":\"x\"}"), BAD("{\"a\":1}", "{\"b\":\"x\"}"));
    check(
        "{\"allOf\":[{\"type\":\"integer\",\"minimum\":0},{\"maximum\":10},{\"type\":\"number\"}]}",
        GOOD("0", "10"), BAD("-1", "11", "1.5"));
    /* additionalProperties merge exactly: the other side's properties must satisfy it */
    check("{\"allOf\":[{\"properties\":{\"a\":{\"type\":\"integer\"}},\"additionalProperties\":"
          "false},"
          "{\"properties\":{\"a\":{\"minimum\":0},\"b\":{}}}]}",
          GOOD("{}", "{\"a\":1}"), BAD("{\"a\":-1}", "{\"b\":1}", "{\"c\":1}"));
    check("{\"properties\":{\"a\":{},\"b\":{}},\"additionalProperties\":false,\"anyOf\":[{"
          "\"properties\":"
          "{\"a\":{\"type\":\"integer\"}},\"required\":[\"a\"]},{\"required\":[\"b\"]}]}",
          GOOD("{\"a\":1}", "{\"b\":\"x\"}", "{\"a\":1,\"b\":2}"),
          BAD("{\"a\":\"x\"}", "{\"c\":1}", "{}"));
    check("{\"allOf\":[{\"additionalProperties\":{\"type\":\"string\"}},{\"properties\":{\"n\":{}}}"
          "]}",
          GOOD("{\"n\":\"s\",\"m\":\"t\"}"), BAD("{\"n\":1}", "{\"m\":1}"));
    refused("{\"allOf\":[{\"pattern\":\"a\"},{\"pattern\":\"b\"}]}",
            "/allOf/1: allOf: two different 'pattern' cannot be merged");
    refused("{\"allOf\":[{\"type\":\"string\"},{\"type\":\"integer\"}]}",
            "/allOf/1: allOf: the types do not intersect");
}

/* Merged properties (allOf, $ref, anyOf / oneOf with siblings) come in document order: each
 * name where it is first defined in the document among the merged schemas (a schema's
 * properties after its additionalProperties counted from there, a $ref's target where the $ref
 * stands). */
/* allOf merges: enums with nothing in common allow no value; if / then / else in allOf
 * branches: `then` / `else` without `if` constrain nothing, and two conditionals both hold
 * (neither side's replaces the other's) */
static void test_all_of_conditionals(void **state)
{
    (void)state;
    check_q("{'allOf':[{'if':{'exclusiveMaximum':0}},{'then':{'minimum':-10}},"
            "{'else':{'multipleOf':2}}]}",
            GOOD("-100", "3", "'x'"), NULL);
    /* enums with no value in common: that branch allows no value and is left out */
    check_q("{'anyOf':[{'allOf':[{'enum':[1,2]},{'enum':[3]}]},{'type':'string'}]}", GOOD("'x'"),
            BAD("1", "3"));
    check_q("{'allOf':[{'if':{'minimum':5},'then':{'maximum':8}},"
            "{'if':{'maximum':3},'then':{'const':1}}]}",
            GOOD("1", "4", "5", "8"), BAD("2", "3", "0", "9", "'x'"));
}

static void test_merged_property_order(void **state)
{
    (void)state;
    /* allOf: a oneOf branch's properties come before the later branch's (five or more
     * properties: up to four come in any order) */
    check_q("{'allOf':[{'oneOf':[{'properties':{'state':{'const':'idle'}},'required':['state']},"
            "{'properties':{'current':{'type':'number'},'state':{'const':'run'},"
            "'total':{'type':'number'}},'required':['state']}],'type':'object'},"
            "{'properties':{'builder':{'type':'object'},'id':{'type':'number'}},"
            "'required':['builder','id']}]}",
            GOOD("{'current':50,'state':'run','total':100,'builder':{},'id':1}",
                 "{'state':'idle','builder':{},'id':1}", "{'id':1,'state':'idle','builder':{}}"),
            BAD("{'builder':{},'id':1,'current':50,'state':'run'}", "{'state':'run','id':1}"));
    /* $ref: siblings written before the $ref's target come first */
    check_q("{'properties':{'c':{'type':'integer'},'d':{},'e':{}},'$ref':'#/$defs/b',"
            "'$defs':{'b':{'properties':{'a':{},'b':{}},'required':['a']}}}",
            GOOD("{'c':1,'a':2,'b':3}", "{'a':2}", "{'c':1,'a':2}", "{'e':1,'a':2}"),
            BAD("{'a':2,'b':3,'c':1}", "{'c':'x','a':2}"));
    check_q("{'$defs':{'b':{'properties':{'a':{},'b':{},'d':{}}}},'$ref':'#/$defs/b',"
            "'properties':{'c':{'type':'integer'},'e':{}}}",
            GOOD("{'a':2,'b':3,'c':1}", "{'b':3}"), BAD("{'c':1,'a':2,'b':3}", "{'c':'x'}"));
    /* anyOf branches written before the sibling properties; four or fewer in any order */
    check_q("{'anyOf':[{'properties':{'x':{'type':'string'}},'required':['x']}],"
            "'properties':{'y':{'type':'integer'}},'required':['y']}",
            GOOD("{'x':'s','y':1}", "{'y':1,'x':'s'}"), BAD("{'x':'s'}", "{'y':1,'x':2}"));
    /* a name both sides define sits at its first definition */
    check_q("{'allOf':[{'properties':{'b':{},'a':{},'d':{}}},"
            "{'properties':{'c':{},'a':{'type':'integer'},'e':{}}}]}",
            GOOD("{'b':1,'a':2,'c':3}", "{'a':2,'c':3}"), BAD("{'b':1,'c':3,'a':2}", "{'a':'x'}"));
    /* properties written after their additionalProperties count from there (llguidance
     * 1.9.1 orders both of these so) */
    const char *branches = "'anyOf':[{'properties':{'g':{'const':1},'r':{}},'required':['g']},"
                           "{'properties':{'g':{'const':2}},'required':['g']}]";
    const char *props = "'properties':{'c':{},'g':{},'p':{},'r':{},'s':{}}";
    char s1[512], s2[512];
    snprintf(s1, sizeof s1, "{'additionalProperties':false,%s,%s}", branches, props);
    snprintf(s2, sizeof s2, "{%s,%s,'additionalProperties':false}", branches, props);
    check_q(s1, GOOD("{'c':1,'g':1,'p':1,'r':1,'s':1}"),
            BAD("{'g':1,'r':1,'c':1,'p':1,'s':1}", "{'c':1,'g':3}"));
    check_q(s2, GOOD("{'g':1,'r':1,'c':1,'p':1,'s':1}"), BAD("{'c':1,'g':1,'p':1,'r':1,'s':1}"));
    /* a $ref's target counts where the $ref stands, not where it is defined */
    check_q("{'$defs':{'b':{'properties':{'a':{},'b':{}}}},'properties':{'c':{},'d':{},'e':{}},"
            "'$ref':'#/$defs/b'}",
            GOOD("{'c':1,'d':1,'e':1,'a':1,'b':1}"), BAD("{'a':1,'b':1,'c':1,'d':1,'e':1}"));
}

static void test_refs(void **state)
{
    (void)state;
    /* recursive: a tree */
    const char *tree = "{\"$ref\":\"#/$defs/node\",\"$defs\":{\"node\":{\"type\":\"object\","
                       "\"properties\":{\"v\":{\"type\":\"integer\"},\"kids\":{\"type\":\"array\","
                       "\"items\":{\"$ref\":\"#/$defs/node\"}}},\"required\":[\"v\"],"
                       "\"additionalProperties\":false}}}";
    check(tree, GOOD("{\"v\":1}", "{\"v\":1,\"kids\":[{\"v\":2,\"kids\":[{\"v\":3}]}]}"),
          BAD("{\"v\":1,\"kids\":[{}]}"));
    check("{\"definitions\":{\"a~b/c\":{\"type\":\"integer\"}},\"items\":{\"$ref\":\"#/definitions/"
          "a~0b~1c\"}}",
          GOOD("[1]"), BAD("[\"x\"]"));
    check("{\"type\":\"array\",\"items\":{\"$ref\":\"#\"}}", GOOD("[]", "[[],[[]]]"), BAD("[1]"));
    /* siblings of $ref apply too (2019-09 and later) */
    check("{\"$defs\":{\"n\":{\"type\":\"integer\"}},\"$ref\":\"#/$defs/n\",\"minimum\":5}",
          GOOD("5"), BAD("4"));
    /* a recursive schema that merges at every level (allOf beside a $ref to itself) */
    check("{\"definitions\":{\"foo\":{\"type\":\"object\",\"properties\":{\"kids\":{\"type\":"
          "\"array\",\"items\":{\"allOf\":[{\"$ref\":\"#/definitions/"
          "foo\"},{\"required\":[\"n\"]}]}},"
          "\"n\":{\"type\":\"integer\"}}}},\"$ref\":\"#/definitions/foo\"}",
          GOOD("{}", "{\"kids\":[{\"n\":1},{\"kids\":[{\"n\":2}],\"n\":3}]}"),
          BAD("{\"kids\":[{}]}", "{\"kids\":[{\"n\":1,\"kids\":[{}]}]}"));
    refused("{\"$ref\":\"#/$defs/missing\"}", "/$ref: '#/$defs/missing' not found");
    refused("{\"$ref\":\"other.json#/a\"}",
            "/$ref: 'other.json#/a' not supported (only JSON pointers and anchors within the "
            "document)");
}

/* $ref "#name": the schema declaring that plain-name anchor ($anchor, $dynamicAnchor, or an
 * id / $id "#name" of drafts 4 to 7), when exactly one does and no embedded resource scopes it. */
static void test_ref_anchors(void **state)
{
    (void)state;
    check_q("{'definitions':{'s':{'id':'#sid','type':'integer','minimum':0},'l':{'$anchor':'lst',"
            "'type':'array','items':{'$ref':'#sid'}}},'type':'object','properties':{'a':{'$ref':"
            "'#lst'},'b':{'$ref':'#sid'}},'required':['a','b'],'additionalProperties':false}",
            GOOD("{'a':[1,2],'b':3}", "{'a':[],'b':0}"),
            BAD("{'a':[1,-2],'b':3}", "{'a':[1],'b':-1}", "{'a':1,'b':1}"));
    /* recursive, through an anchor on the root; an $id '#name' (drafts 6, 7) */
    check_q("{'$anchor':'node','type':'array','items':{'$ref':'#node'}}", GOOD("[]", "[[],[[]]]"),
            BAD("[1]"));
    check_q("{'$defs':{'n':{'$id':'#num','type':'number'}},'items':{'$ref':'#num'}}", GOOD("[1.5]"),
            BAD("['x']"));
    /* anchors in data (const, enum, default, examples) name nothing */
    refused("{\"properties\":{\"a\":{\"$ref\":\"#x\"}},\"$defs\":{\"d\":{\"const\":"
            "{\"$anchor\":\"x\"}}}}",
            "/properties/a/$ref: '#x' not found (no $anchor or id of that name)");
    refused("{\"properties\":{\"a\":{\"$ref\":\"#x\"}},\"$defs\":{\"d\":{\"$anchor\":"
            "\"x\"},\"e\":{\"$anchor\":\"x\"}}}",
            "/properties/a/$ref: '#x' is ambiguous (2 schemas declare that anchor)");
    refused("{\"properties\":{\"a\":{\"$ref\":\"#x\"}},\"$defs\":{\"d\":{\"$id\":"
            "\"http://example.com/d\",\"$anchor\":\"x\"}}}",
            "/properties/a/$ref: '#x' not supported (an anchor in a document with embedded "
            "resources, $id)");
    /* an item schema no value fits: only the empty array */
    check_q("{'$defs':{'t':{'$anchor':'t','type':'string','enum':[1]}},'items':{'$ref':'#t'}}",
            GOOD("[]", "1", "{}"), BAD("[1]", "['1']"));
    /* an error inside the target names the target's pointer */
    refused("{\"$defs\":{\"t\":{\"$anchor\":\"t\",\"type\":\"string\",\"enum\":[1]}},"
            "\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#t\"}},\"required\":[\"a\"]}",
            "/$defs/t/enum: no value allowed (type, enum and const)");
}

static void test_string_lengths_and_pattern(void **state)
{
    (void)state;
    check("{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}",
          GOOD("\"ab\"", "\"a\\nb\"", "\"\xc3\xa9\xc3\xa9\""), BAD("\"a\"", "\"abcd\""));
    /* counts over the engine's repetition limit are nested */
    tdm_grammar_t *g = compile("{\"type\":\"string\",\"minLength\":2500,\"maxLength\":12345}");
    char *text = malloc(12350);
    assert_non_null(text);
    for (size_t n = 2498; n <= 2502; n++) {
        text[0] = '"';
        memset(text + 1, 'x', n);
        memcpy(text + 1 + n, "\"", 2);
        assert_int_equal(grammar_accepts(g, text), n >= 2500);
    }
    for (size_t n = 12343; n <= 12346; n++) {
        memset(text + 1, 'x', n);
        memcpy(text + 1 + n, "\"", 2);
        assert_int_equal(grammar_accepts(g, text), n <= 12345);
    }
    free(text);
    tdm_grammar_destroy(&g);
    check("{\"type\":\"string\",\"pattern\":\"^[a-z]+-\\\\d{2,3}$\"}",
          GOOD("\"ab-12\"", "\"x-123\""), BAD("\"ab-1\"", "\"AB-12\"", "\"ab-1234\""));
    /* unanchored: search semantics */
    check("{\"type\":\"string\",\"pattern\":\"ab\"}", GOOD("\"ab\"", "\"xaby\""), BAD("\"a b\""));
    check("{\"type\":\"string\",\"pattern\":\"^(foo|ba[rz])?$\"}",
          GOOD("\"\"", "\"foo\"", "\"baz\""), BAD("\"bar \""));
    /* NUL: the regex escape \\u0000, and the character itself (JSON escape in the schema) */
    check("{\"type\":\"string\",\"pattern\":\"^[^\\\\u0000]+$\"}", GOOD("\"ab\""),
          BAD("\"a\\u0000\"", "\"\""));
    check("{\"type\":\"string\",\"pattern\":\"^[^\\u0000]+$\"}", GOOD("\"ab\""),
          BAD("\"a\\u0000\""));
    /* JSON escapes of the characters a pattern allows */
    check("{\"type\":\"string\",\"pattern\":\"^[\\\"\\\\\\\\]+$\"}", GOOD("\"\\\"\\\\\""),
          BAD("\"a\""));
    check("{\"type\":\"string\",\"pattern\":\"^[^a]$\"}", GOOD("\"b\"", "\"\\\"\""),
          BAD("\"a\"", "\"\""));
    /* a length bound the pattern already implies is kept; another is refused */
    check("{\"type\":\"string\",\"pattern\":\"^[a-z]{2}$\",\"maxLength\":5}", GOOD("\"ab\""),
          BAD("\"a\""));
    /* built in when exact: one repeated class in an anchored pattern */
    check("{\"type\":\"string\",\"pattern\":\"^[a-z]+$\",\"maxLength\":5}",
          GOOD("\"a\"", "\"abcde\""), BAD("\"\"", "\"abcdef\"", "\"ab1\""));
    check("{\"type\":\"string\",\"pattern\":\"^id-[0-9a-f]*-x$\",\"minLength\":7,\"maxLength\":8}",
          GOOD("\"id-ab-x\"", "\"id-abc-x\""), BAD("\"id-a-x\"", "\"id-abcd-x\""));
    /* any other shape: the pattern's automaton times a length counter (exact) */
    check("{\"type\":\"string\",\"pattern\":\"^[a-z]+[0-9]+$\",\"maxLength\":5}",
          GOOD("\"a1\"", "\"abc12\"", "\"a1234\""), BAD("\"abc123\"", "\"a\"", "\"1\"", "\"a1b\""));
    check("{\"type\":\"string\",\"pattern\":\"[a-z]+\",\"maxLength\":5}",
          GOOD("\"a\"", "\"1a2\"", "\"\\\"a\\n\"", "\"1234a\""),
          BAD("\"\"", "\"123\"", "\"123456\"", "\"abcdef\""));
    check("{\"type\":\"string\",\"pattern\":\"^(ab|c)*$\",\"minLength\":3,\"maxLength\":4}",
          GOOD("\"abc\"", "\"cab\"", "\"abab\"", "\"cccc\""),
          BAD("\"ab\"", "\"ababc\"", "\"aba\"", "\"cc\""));
    check("{\"type\":\"string\",\"pattern\":\"^x\",\"minLength\":3}",
          GOOD("\"xyz\"", "\"x\\u0001\\\"\"", "\"xyzzzzzzz\""), BAD("\"xy\"", "\"axyz\""));
    refused("{\"type\":\"string\",\"pattern\":\"^a{1,3}$\",\"minLength\":4}",
            "/minLength: no string matches (format, pattern, lengths, not)");
    refused(
        "{\"properties\":{\"a\":{\"pattern\":\"(?=x)\"}}}",
        "/properties/a/pattern: group kind not supported (lookahead, flags, ...) (at offset 2)");
    /* anchors inside and leading lookaheads: through the automaton */
    check_q("{'type':'string','pattern':'(^a|b$)'}", GOOD("'ax'", "'xb'", "'ab'"),
            BAD("'xa'", "'bx'"));
    check_q("{'type':'string','pattern':'^(?=.*[A-Z])(?=.*\\\\d)(?!.*\\\\s).{8,}$'}",
            GOOD("'Abcdefg1'", "'xxxxxxA9'"),
            BAD("'abcdefg1'", "'Abcdefgh'", "'Abc defg1'", "'Ab1'"));
    check_q("{'type':'string','pattern':'^(?!admin$)[a-z]+$','maxLength':6}",
            GOOD("'admins'", "'bob'"), BAD("'admin'", "'toolong'", "'Bob'"));
    check_q("{'pattern':'a^b'}", GOOD("1", "null", "{}"), BAD("''", "'ab'", "'a^b'"));
    refused("{\"type\":\"string\",\"pattern\":\"a^b\"}",
            "/pattern: no string matches (format, pattern, lengths, not)");
    refused("{\"pattern\":\"(?<=a)b\"}", "/pattern: lookbehind not supported (at offset 2)");
    refused("{\"pattern\":\"(a)\\\\1\"}",
            "/pattern: escape not supported (backreference, \\p, \\B, ...) (at offset 5)");
}

static void test_formats(void **state)
{
    (void)state;
    check("{\"format\":\"date\",\"type\":\"string\"}",
          GOOD("\"2024-02-29\"", "\"2000-02-29\"", "\"2023-12-31\"", "\"2023-04-30\""),
          BAD("\"2023-02-29\"", "\"1900-02-29\"", "\"2023-04-31\"", "\"2023-13-01\"",
              "\"23-01-01\""));
    /* a leap second only at 23:59:60 UTC, i.e. with a zero offset (RFC 3339 5.7) */
    check("{\"format\":\"time\"}", NULL,
          BAD("\"23:59:60.5+01:00\"", "\"12:30:60Z\"", "\"23:58:60Z\""));
    check("{\"format\":\"time\"}", GOOD("\"12:30:00Z\"", "\"23:59:60.5Z\"", "\"23:59:60-00:00\""),
          BAD("\"24:00:00Z\"", "\"12:30:00\""));
    check("{\"format\":\"date-time\"}",
          GOOD("\"2024-01-02T03:04:05Z\"", "\"2024-01-02t03:04:05.123-08:00\""),
          BAD("\"2024-01-02 03:04\""));
    check("{\"format\":\"uuid\"}", GOOD("\"123e4567-e89b-12d3-a456-426614174000\""),
          BAD("\"123e4567\""));
    check("{\"format\":\"email\"}", GOOD("\"a.b+c@example.com\"", "\"x@localhost\""),
          BAD("\"a@\"", "\"@b.c\"", "\"a b@c.d\""));
    check("{\"format\":\"uri\"}", GOOD("\"https://example.com/a?b=c#d\"", "\"urn:isbn:123\""),
          BAD("\"example.com\"", "\"http://a b\""));
    check("{\"format\":\"ipv4\"}", GOOD("\"192.168.0.255\""), BAD("\"256.1.1.1\"", "\"1.2.3\""));
    check("{\"format\":\"hostname\"}", GOOD("\"a-b.example.com\""), BAD("\"-a.com\""));
    check_q("{'format':'ipv6'}",
            GOOD("'::'", "'::1'", "'1:2:3:4:5:6:7:8'", "'fe80::1:2'", "'1::'", "'::ffff:1.2.3.4'",
                 "'1:2:3:4:5:6:1.2.3.4'", "'1:2:3:4:5:6:7::'", "'ABCD:ef01::'"),
            BAD("'1:2:3:4:5:6:7:8:9'", "'1::2::3'", "':1:2:3:4:5:6:7'", "'12345::'",
                "'1:2:3:4:5:6:7'", "'::1.2.3.256'", "'fe80::1%eth0'", "'g::'"));
    check_q("{'format':'duration'}",
            GOOD("'P4DT12H30M5S'", "'P1Y'", "'P1Y2M'", "'P2M1D'", "'PT1H'", "'PT36H'", "'PT5S'",
                 "'P4W'", "'PT1M2S'"),
            BAD("'P'", "'PT'", "'P1D2M'", "'P1Y1D'", "'PT1H2S'", "'P1W1D'", "'P1.5D'", "'1D'",
                "'P1DT'"));
    refused("{\"type\":\"string\",\"format\":\"idn-hostname\"}",
            "/format: 'idn-hostname' not supported");
    /* a custom format is an annotation: the schema compiles as without it */
    check_q("{'type':'string','format':'my-color','maxLength':3}", GOOD("'red'", "''"),
            BAD("'blue'", "1"));
    check_q("{'type':'integer','format':'int64'}", GOOD("12"), BAD("1.5"));
    check_q("{'allOf':[{'format':'date'},{'format':'x-custom'}]}", GOOD("'2024-01-01'"),
            BAD("'x'"));
    check_q("{'format':'date','maxLength':9}", GOOD("1", "[]"), BAD("'2024-01-01'", "''"));
    refused("{\"type\":[\"string\"],\"format\":\"date\",\"maxLength\":9}",
            "/maxLength: no string matches (format, pattern, lengths, not)");
}

/* The formats compiled from their regexes, and formats beside pattern / lengths. */
static void test_formats_regex(void **state)
{
    (void)state;
    check_q("{'format':'json-pointer'}", GOOD("''", "'/a'", "'/a~0b/~1'", "'/'", "'/a\\\"'"),
            BAD("'a'", "'/~2'", "'/~'"));
    check_q("{'format':'relative-json-pointer'}", GOOD("'0'", "'1/a'", "'2#'", "'10/b~1'"),
            BAD("'01'", "'#'", "'-1/a'", "'1#/a'"));
    check_q("{'format':'uri-reference'}",
            GOOD("''", "'a/b'", "'//host:80/p?q#f'", "'http://[::1]/x'", "'../x?y'", "'mailto:a@b'",
                 "'#frag'", "'http://u:p@[v1.x]/'"),
            BAD("'a b'", "':x'", "'http://[::g]/'", "'%zz'", "'a#b#c'", "'http://a/\\u00e9'"));
    check_q("{'format':'iri'}",
            GOOD("'http://\xe4\xbe\x8b\xe3\x81\x88.jp/\xe3\x83\x91\xe3\x82\xb9'", "'urn:x'"),
            BAD("'//x'", "'http://a b'", "'a/b'"));
    check_q("{'format':'iri-reference'}", GOOD("'\xe3\x83\x91\xe3\x82\xb9/x'", "''"), BAD("'a b'"));
    check_q("{'format':'uri-template'}",
            GOOD("'http://ex.com/{id}/{+path}{?q,lang}'", "'{x:3}'", "'{list*}'", "'plain'"),
            BAD("'{'", "'{}'", "'{a b}'", "'a}'", "'{x:0}'"));
    check_q("{'format':'host-name'}", GOOD("'a-b.c'"), BAD("'-a'", "'a..b'"));
    check_q("{'format':'ip-address'}", GOOD("'1.2.3.4'"), BAD("'256.1.1.1'", "'1.2.3'"));
    /* beside lengths and patterns: the intersection, exactly */
    check_q("{'format':'email','maxLength':8}", GOOD("'a@b.cd'", "'ab@c.de'"),
            BAD("'abcde@f.gh'", "'a@@b'"));
    check_q("{'format':'ipv4','pattern':'^10\\\\.'}", GOOD("'10.1.2.3'"),
            BAD("'11.1.2.3'", "'10.1.2.256'", "'10.1.2'"));
    check_q("{'format':'hostname','minLength':3}", GOOD("'abc'", "'a.b'"), BAD("'ab'", "'a.'"));
    check_q("{'format':'date','minLength':10,'pattern':'-02-'}", GOOD("'2024-02-29'"),
            BAD("'2023-02-29'", "'2024-03-01'"));
}

static void test_integer_bounds(void **state)
{
    (void)state;
    check("{\"type\":\"integer\",\"minimum\":1,\"maximum\":120}",
          GOOD("1", "9", "10", "99", "100", "120"), BAD("0", "121", "200", "1000", "-1", "01"));
    check("{\"type\":\"integer\",\"minimum\":-15,\"maximum\":-3}", GOOD("-15", "-3", "-10"),
          BAD("-16", "-2", "0", "3"));
    check("{\"type\":\"integer\",\"exclusiveMinimum\":0}", GOOD("1", "12345678901"),
          BAD("0", "-1"));
    check("{\"type\":\"integer\",\"maximum\":5}", GOOD("5", "0", "-1000"), BAD("6", "10"));
    check("{\"type\":\"integer\",\"minimum\":37,\"maximum\":4321}",
          GOOD("37", "99", "100", "4321", "4300"), BAD("36", "4322", "5000", "10000"));
    /* draft 4 booleans; non-integral bounds round inward */
    check("{\"type\":\"integer\",\"minimum\":0,\"exclusiveMinimum\":true,\"maximum\":2.5}",
          GOOD("1", "2"), BAD("0", "3"));
    check_q("{'type':'integer','exclusiveMinimum':-2.5,'maximum':1.5}", GOOD("-2", "0", "1"),
            BAD("-3", "2"));
    check_q("{'type':'integer','exclusiveMaximum':0}", GOOD("-1", "-100"), BAD("0", "1"));
    check_q("{'type':'integer','minimum':1e20,'exclusiveMaximum':1.0000000000000002e20}",
            GOOD("100000000000000000000", "100000000000000000001", "100000000000000019999"),
            BAD("99999999999999999999", "100000000000000020000", "1e20"));
    check_q("{'type':'integer','minimum':-9223372036854775808,'maximum':9223372036854775807}",
            GOOD("-9223372036854775808", "9223372036854775807", "0"),
            BAD("-9223372036854775809", "9223372036854775808"));
    /* integers beyond 64 bits: read exactly, digit for digit */
    check_q("{'type':'integer','minimum':0,'maximum':18446744073709551615,"
            "'default':123456789012345678901234567890,'description':'a 1.5e300 x'}",
            GOOD("18446744073709551615", "18446744073709551614", "0"),
            BAD("18446744073709551616", "18446744073709552000", "-1"));
    check_q("{'type':'number','exclusiveMinimum':-100000000000000000000000000001,'maximum':"
            "0.12345678901234567890123}",
            GOOD("-100000000000000000000000000000", "0.1234"),
            BAD("-100000000000000000000000000001", "0.2"));
    refused("{\"enum\":[1,123456789012345678901234567890]}",
            "/enum: integers beyond 64 bits in values not supported");
    refused("{\"type\":\"integer\",\"minimum\":3,\"maximum\":2}",
            "/minimum: no integer within the bounds");
}

static void test_number_bounds(void **state)
{
    (void)state;
    check("{\"type\":\"number\",\"minimum\":0,\"maximum\":1}",
          GOOD("0", "0.5", "1", "1.0", "1.000"), BAD("-0.5", "1.01", "2", "1e0", "-1"));
    check("{\"type\":\"number\",\"minimum\":0}", GOOD("0", "3.5", "1e+20", "2E5"),
          BAD("-1", "-0.1"));
    check("{\"type\":\"number\",\"exclusiveMinimum\":0,\"maximum\":100}", GOOD("0.01", "1", "100"),
          BAD("0", "0.0", "100.5", "-3"));
    check("{\"type\":\"number\",\"minimum\":-10,\"exclusiveMaximum\":-2}",
          GOOD("-10", "-2.5", "-9.99"), BAD("-2", "-10.5", "0"));
    check("{\"type\":\"number\",\"maximum\":0}", GOOD("0", "-5e+3", "-0.5"), BAD("0.1", "1"));
    /* non-integral bounds, exact */
    check_q("{'type':'number','minimum':0,'maximum':0.5}",
            GOOD("0", "0.0", "0.5", "0.50", "0.4999", "0.05", "0.1"),
            BAD("0.51", "0.5000001", "1", "-0.1", "0.6"));
    check_q("{'type':'number','exclusiveMinimum':0.25,'exclusiveMaximum':0.3}",
            GOOD("0.26", "0.2501", "0.29999", "0.250001"),
            BAD("0.25", "0.250", "0.3", "0.30", "0.2", "0", "0.31"));
    check_q("{'type':'number','minimum':1.5,'maximum':12.75}",
            GOOD("1.5", "1.50", "1.6", "2", "9.99", "12", "12.75", "12.7", "12.750"),
            BAD("1.4", "1.49999", "1", "12.751", "12.8", "13", "0.5"));
    check_q("{'type':'number','exclusiveMinimum':-2.5,'maximum':-0.125}",
            GOOD("-2.4", "-2", "-1", "-0.125", "-0.2", "-2.49"),
            BAD("-2.5", "-2.50", "-3", "-0.12", "0", "-0.1249"));
    check_q("{'type':'number','minimum':1}", GOOD("1", "1.5", "2", "10"), BAD("0", "0.5", "0.0"));
    check_q("{'type':'number','minimum':-0.5}", GOOD("-0.5", "-0.05", "0", "1e+30", "7.25"),
            BAD("-0.51", "-1", "-0.6"));
    check_q("{'type':'number','exclusiveMaximum':1e-3}", GOOD("0.0009", "0", "-5", "-1e+9"),
            BAD("0.001", "0.0010", "0.002", "1"));
    check_q("{'type':'number','minimum':0.1,'maximum':0.1}", GOOD("0.1", "0.100"),
            BAD("0.10001", "0.09", "0"));
    /* bounds beyond 64 bits and of any decimal */
    check_q("{'type':'number','maximum':1e30,'minimum':-1e20}",
            GOOD("1000000000000000000000000000000", "-100000000000000000000", "5"),
            BAD("1000000000000000000000000000001", "-100000000000000000001"));
}

/* Random bounds against an oracle: decimals of at most 4 significant digits compare exactly as
 * doubles, so strtod decides which texts each schema allows. */
static void test_bounds_random(void **state)
{
    (void)state;
    static const char *const b[] = {"-12.5", "-2",  "-1.25", "-1",   "-0.5", "-0.05", "0",  "0.05",
                                    "0.3",   "0.5", "1",     "1.25", "2",    "9.99",  "10", "12.5"};
    static const char *const key[2][2] = {{"minimum", "exclusiveMinimum"},
                                          {"maximum", "exclusiveMaximum"}};
    unsigned seed = 12345;
    char texts[300][16];
    int nt = 0;
    for (int x = -1400; x <= 1400 && nt < 300; x += 11)
        snprintf(texts[nt++], sizeof texts[0], x % 3 ? "%.2f" : "%.0f", x / 100.0);
    for (int x = -20; x <= 20; x++)
        snprintf(texts[nt < 299 ? nt++ : nt], sizeof texts[0], "%d", x);
    snprintf(texts[nt++], sizeof texts[0], "0.050");
    for (int round = 0; round < 200; round++) {
        seed = seed * 1103515245u + 12345u;
        int lo = (int)(seed >> 8) % 17 - 1, lk = (int)(seed >> 4) % 2;
        seed = seed * 1103515245u + 12345u;
        int hi = (int)(seed >> 8) % 17 - 1, hk = (int)(seed >> 4) % 2, integer = round % 2;
        char schema[160];
        int n = snprintf(schema, sizeof schema, "{\"type\":\"%s\"", integer ? "integer" : "number");
        if (lo >= 0)
            n += snprintf(schema + n, sizeof schema - (size_t)n, ",\"%s\":%s", key[0][lk], b[lo]);
        if (hi >= 0)
            n += snprintf(schema + n, sizeof schema - (size_t)n, ",\"%s\":%s", key[1][hk], b[hi]);
        snprintf(schema + n, sizeof schema - (size_t)n, "}");
        tdm_buf_t out = TDM_BUF_INIT;
        tdm_error_t err;
        if (tdm_json_schema_to_gbnf(schema, strlen(schema), &out, &err) != 0) {
            tdm_buf_free(&out);
            continue; /* no value within the bounds */
        }
        tdm_grammar_t *g = tdm_grammar_parse(out.data, out.len, NULL, &err);
        assert_non_null(g);
        for (int i = 0; i < nt; i++) {
            double v = strtod(texts[i], NULL);
            double l = lo >= 0 ? strtod(b[lo], NULL) : 0, h = hi >= 0 ? strtod(b[hi], NULL) : 0;
            bool ok = (lo < 0 || (lk ? v > l : v >= l)) && (hi < 0 || (hk ? v < h : v <= h));
            bool is_int = strchr(texts[i], '.') == NULL;
            if (integer && !is_int)
                ok = false; /* "2.0" is an integer, but not written so by the grammar */
            if (strcmp(texts[i], "-0") == 0 || strcmp(texts[i], "-0.00") == 0)
                continue; /* zero with a sign: not written */
            if (grammar_accepts(g, texts[i]) != ok)
                fail_msg("schema %s %s %s\n%s", schema, ok ? "should accept" : "should reject",
                         texts[i], out.data);
        }
        tdm_grammar_destroy(&g);
        tdm_buf_free(&out);
    }
}

static void test_dependent_required(void **state)
{
    (void)state;
    /* card requires billing; billing alone is fine */
    const char *s =
        "{'type':'object','properties':{'name':{'type':'string'},'card':{'type':'integer'},"
        "'billing':{'type':'string'}},'dependentRequired':{'card':['billing']}}";
    check_q(s,
            GOOD("{}", "{'name':'a'}", "{'card':1,'billing':'x'}", "{'billing':'x'}",
                 "{'name':'a','card':1,'billing':'x'}"),
            BAD("{'card':1}", "{'name':'a','card':1}", "{'card':'1','billing':'x'}"));
    /* draft-7 dependencies with arrays; two triggers; a trigger already required */
    check_q("{'properties':{'a':{},'b':{},'c':{},'d':{}},'required':['d'],"
            "'dependencies':{'a':['b'],'b':['c'],'d':['c']}}",
            GOOD("{'c':1,'d':1}", "{'b':1,'c':1,'d':1}", "{'a':1,'b':1,'c':1,'d':1}", "1"),
            BAD("{'d':1}", "{'a':1,'c':1,'d':1}", "{'b':1,'d':1}"));
    /* additional properties still allowed; a dependent defined nowhere is required as one */
    check_q("{'properties':{'a':{}},'dependentRequired':{'a':['z']}}",
            GOOD("{'a':1,'z':2}", "{'q':1}"), BAD("{'a':1}", "{'a':1,'q':1}"));
    /* a trigger not defined: absent, or present as an additional property */
    check_q("{'properties':{'b':{'type':'integer'}},'dependentRequired':{'a':['b']}}",
            GOOD("{}", "{'b':1}", "{'b':1,'a':'x'}", "{'c':1}"), BAD("{'a':1}", "{'c':1,'a':1}"));
    check_q("{'properties':{'b':{}},'additionalProperties':false,'dependentRequired':{'a':['b']}}",
            GOOD("{}", "{'b':1}"), BAD("{'a':1}"));
    /* schema dependencies: a present trigger's case merged with its schema */
    check_q("{'properties':{'a':{},'b':{}},'dependencies':{'a':{'required':['b']}}}",
            GOOD("{}", "{'b':1}", "{'a':1,'b':2}"), BAD("{'a':1}"));
    check_q("{'type':'object','properties':{'card':{'type':'string'},'cvv':{}},"
            "'dependentSchemas':{'card':{'properties':{'cvv':{'type':'integer'}},'required':"
            "['cvv']}}}",
            GOOD("{'card':'x','cvv':123}", "{'cvv':'any'}", "{}"),
            BAD("{'card':'x'}", "{'card':'x','cvv':'1'}"));
    check_q("{'dependentSchemas':{'foo':true,'bar':false}}", GOOD("{}", "{'foo':1}"),
            BAD("{'bar':2}", "{'foo':1,'bar':2}"));
    check_q("{'required':['a'],'properties':{'a':{},'n':{}},'dependentSchemas':{'a':{'properties':"
            "{'n':{'type':'integer'}}}}}",
            GOOD("{'a':1,'n':2}", "{'a':1}"), BAD("{'a':1,'n':'x'}", "{'n':1}"));
    refused("{\"properties\":{\"a\":{},\"b\":{},\"c\":{},\"d\":{},\"e\":{}},"
            "\"dependentRequired\":{\"a\":[\"b\"],\"b\":[\"c\"],\"c\":[\"d\"],"
            "\"d\":[\"e\"],\"e\":[\"a\"]}}",
            "/dependentRequired: 'e': more than 4 properties not required have dependents (not "
            "supported)");
}

static void test_not_type(void **state)
{
    (void)state;
    check_q("{'not':{'type':'string'}}", GOOD("1", "null", "[1]", "{'a':'b'}", "true"), BAD("'a'"));
    check_q("{'type':['string','integer','null'],'not':{'type':['null','string']}}", GOOD("1"),
            BAD("null", "'a'", "1.5"));
    check_q("{'not':{'type':'number','title':'t'}}", GOOD("'a'"), BAD("1", "1.5"));
    check_q("{'enum':[1,'a',null],'not':{'type':'null'}}", GOOD("1", "'a'"), BAD("null"));
    check_q("{'properties':{'a':{'not':{'type':'object'}}}}", GOOD("{'a':1}"), BAD("{'a':{}}"));
    check_q("{'not':false}", GOOD("1"), NULL);
    refused("{\"not\":{\"type\":\"integer\"}}",
            "/not: not supported: 'integer' excluded from 'number'");
    refused("{\"type\":\"string\",\"not\":{\"type\":\"string\"}}",
            "/not: excludes every type allowed");
    refused("{\"not\":{}}", "/not: excludes every value");
    /* two nots of one form merge into one: not (A or B) */
    check_q("{'allOf':[{'not':{'type':'null'}},{'not':{'type':'string'}}]}", GOOD("1", "[]"),
            BAD("null", "'a'"));
    check_q("{'allOf':[{'not':{'enum':['a']}},{'not':{'const':'b'}}]}", GOOD("'c'", "1"),
            BAD("'a'", "'b'"));
    refused("{\"allOf\":[{\"not\":{\"type\":\"null\"}},{\"not\":{\"enum\":[\"a\"]}}]}",
            "/allOf/1: allOf: two different 'not' cannot be merged");
}

/* not in other forms than {type}: the complement's cases merged with the rest */
static void test_not_forms(void **state)
{
    (void)state;
    /* nested anyOf / oneOf complemented: not anyOf is every branch's complement at once; not
     * oneOf adds the values two branches match */
    check_q("{'not':{'anyOf':[{'type':'string'},{'minimum':2}]}}", GOOD("1", "-5", "1.5"),
            BAD("'a'", "3", "null", "[]"));
    check_q("{'oneOf':[{'anyOf':[{'const':'a'},{'const':'b'}]},{'enum':['b','c']}]}",
            GOOD("'a'", "'c'"), BAD("'b'", "'d'", "1"));
    check_q("{'not':{'oneOf':[{'type':'string'},{'minLength':2}]}}", GOOD("'ab'", "'abc'"),
            BAD("'a'", "null", "1"));
    /* member counts: not {minProperties: n} is the objects of fewer than n members, not
     * {maxProperties: n} those of more (other types pass the count, so fail the not) */
    check_q("{'not':{'minProperties':2}}", GOOD("{}", "{'a':1}"), BAD("{'a':1,'b':2}", "1"));
    check_q("{'oneOf':[{'maxProperties':1},{'required':['a']}],'properties':{'a':{},'b':{}},"
            "'additionalProperties':false}",
            GOOD("{}", "{'b':1}", "{'a':1,'b':2}"), BAD("{'a':1}"));
    check_q("{'not':{'enum':['a','b']}}", GOOD("'c'", "1", "null", "'ab'", "''", "true"),
            BAD("'a'", "'b'"));
    check_q("{'type':'string','not':{'const':'x'}}", GOOD("'y'", "'xx'", "''"), BAD("'x'", "1"));
    check_q("{'type':['boolean','null'],'not':{'const':true}}", GOOD("false", "null"),
            BAD("true", "1"));
    check_q("{'enum':['a','b','c'],'not':{'enum':['b']}}", GOOD("'a'", "'c'"), BAD("'b'"));
    check_q("{'enum':[1,2],'not':{'const':1.0}}", GOOD("2"), BAD("1", "1.0"));
    check_q("{'type':'object','not':{'required':['a']}}", GOOD("{}", "{'b':1}"),
            BAD("{'a':1}", "{'b':1,'a':2}"));
    check_q("{'type':'integer','not':{'minimum':5}}", GOOD("4", "-1"), BAD("5", "6"));
    check_q("{'not':{'minimum':1}}", GOOD("0.5", "-3"), BAD("1", "'a'", "null"));
    check_q("{'type':'string','not':{'minLength':3}}", GOOD("'ab'", "''"), BAD("'abc'"));
    check_q("{'type':'object','properties':{'k':{'type':'string'}},"
            "'not':{'properties':{'k':{'type':'string','minLength':2}}}}",
            GOOD("{'k':'a'}"), BAD("{}", "{'k':'ab'}", "{'k':1}"));
    check_q("{'not':{'type':'string','enum':['a']}}", GOOD("1", "'b'"), BAD("'a'"));
    check_q("{'not':{'allOf':[{'type':'integer'},{'minimum':3}]},'type':'integer'}", GOOD("2"),
            BAD("3"));
    check_q("{'type':'string','not':{'not':{'const':'a'}}}", GOOD("'a'"), BAD("'b'"));
    /* not: {pattern} / {format}: the strings that do not match (non-strings match them) */
    check_q("{'not':{'pattern':'a'}}", GOOD("'b'", "''"), BAD("'xay'", "1", "null"));
    check_q("{'type':'string','not':{'format':'ipv4'}}", GOOD("'1.2.3'", "'x'"), BAD("'1.2.3.4'"));
    check_q("{'type':'string','pattern':'^[a-z]+$','not':{'pattern':'^ab'},'maxLength':3}",
            GOOD("'acd'", "'b'"), BAD("'abc'", "'ab'", "'bcde'", "'B'"));
    check_q("{'oneOf':[{'type':'string','pattern':'^a'},{'type':'string','pattern':'b$'}]}",
            GOOD("'ax'", "'xb'"), BAD("'ab'", "'x'", "1"));
    refused("{\"type\":\"number\",\"not\":{\"enum\":[1]}}",
            "/not: not supported (not: {enum} with numbers, objects or arrays)");
}

/* if / then / else: (if and then) or (not if and else) */
static void test_if_then_else(void **state)
{
    (void)state;
    check_q("{'type':'object','properties':{'kind':{'type':'string'},'n':{}},"
            "'if':{'properties':{'kind':{'const':'num'}}},'then':{'properties':{'n':{'type':"
            "'number'}}},'else':{'properties':{'n':{'type':'string'}}}}",
            GOOD("{'kind':'num','n':1}", "{'kind':'str','n':'x'}", "{'n':1}"),
            BAD("{'kind':'num','n':'x'}", "{'kind':'str','n':1}", "{'n':'x'}"));
    check_q("{'if':{'type':'string'},'then':{'minLength':2}}", GOOD("'ab'", "1", "null"),
            BAD("'a'"));
    check_q("{'type':'integer','if':{'minimum':10},'else':{'maximum':3}}", GOOD("10", "3", "-5"),
            BAD("4", "9"));
    check_q("{'if':{'pattern':'^a'},'then':{'minLength':3}}", GOOD("'abc'", "'b'", "1"),
            BAD("'ab'"));
    refused("{\"if\":{\"additionalProperties\":false},\"then\":{}}",
            "/if/additionalProperties: not supported in a negation (oneOf, if, not)");
}

/* A subschema whose grammar would pass the engine's 1 MiB text limit is refused at compile
 * time with its own pointer (40,000 enum strings with distinct 30-byte tails). */
static void test_grammar_size_limit(void **state)
{
    (void)state;
    tdm_buf_t schema = TDM_BUF_INIT, out = TDM_BUF_INIT;
    tdm_buf_puts(&schema, "{\"properties\":{\"b\":{},\"a\":{\"enum\":[");
    for (int i = 0; i < 40000; i++)
        tdm_buf_printf(&schema, "%s\"v%05d-abcdefghijklmnopqrstuvwxyz0123\"", i ? "," : "", i);
    tdm_buf_puts(&schema, "]}}}");
    assert_false(schema.oom);
    tdm_error_t err;
    assert_int_equal(tdm_json_schema_to_gbnf(schema.data, schema.len, &out, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "/properties/a: compiles to "));
    assert_non_null(strstr(err.msg, "bytes of grammar, over the limit of 1048576"));
    assert_true(out.len == 0);
    tdm_buf_free(&schema);
    tdm_buf_free(&out);
}

/* uniqueItems over a finite set of item values: no value twice, in any order */
static void test_unique_items(void **state)
{
    (void)state;
    check_q("{'type':'array','items':{'enum':['a','b','c']},'uniqueItems':true}",
            GOOD("[]", "['a']", "['b','a']", "['a','b','c']", "[ 'c' , 'a' ]"),
            BAD("['a','a']", "['a','b','a']", "['d']", "['a','b','c','a']"));
    check_q("{'type':'array','items':{'enum':['a','b','c']},'uniqueItems':true,'minItems':2,"
            "'maxItems':2}",
            GOOD("['a','b']", "['c','a']"), BAD("['a']", "['a','b','c']", "['b','b']"));
    check_q("{'items':{'type':'boolean'},'uniqueItems':true}", GOOD("[true,false]", "'x'", "[]"),
            BAD("[true,true]", "[null]"));
    check_q("{'items':{'enum':[1,1.0,2]},'uniqueItems':true,'type':'array'}",
            GOOD("[1,2]", "[1.0]", "[2,1]"), BAD("[1,1.0]", "[1,1]", "[3]"));
    check_q("{'items':{'type':'string'},'uniqueItems':true,'maxItems':1}", GOOD("['x']", "[]"),
            BAD("['x','y']"));
    check_q("{'enum':[[1,1],[1,2]],'uniqueItems':true}", GOOD("[1,2]"), BAD("[1,1]"));
    check_q("{'allOf':[{'uniqueItems':false},{'uniqueItems':true,'items':{'const':'a'}}]}",
            GOOD("['a']"), BAD("['a','a']"));
    refused("{\"type\":\"array\",\"items\":{\"enum\":[\"a\"]},\"uniqueItems\":true,\"minItems\":2}",
            "/minItems: more items than distinct values");
    refused("{\"items\":{\"type\":\"string\"},\"uniqueItems\":true}",
            "/items: uniqueItems: items must be an enum, a const, booleans or null");
}

/* multipleOf: the remainder automaton over the digits, or the multiples between two bounds */
static void test_multiple_of(void **state)
{
    (void)state;
    check_q("{'type':'integer','multipleOf':5}", GOOD("0", "5", "-10", "1234567890"),
            BAD("3", "-7", "12", "5.5"));
    check_q("{'type':'integer','multipleOf':3,'minimum':0}", GOOD("0", "3", "999", "123456"),
            BAD("-3", "4", "1000"));
    check_q("{'type':'integer','multipleOf':7,'exclusiveMinimum':0}", GOOD("7", "14", "700"),
            BAD("0", "-7", "8"));
    check_q("{'type':'integer','multipleOf':10,'minimum':5,'maximum':35}",
            GOOD("10", "20", "30", "20.0"), BAD("0", "40", "15", "5"));
    check_q("{'type':'integer','multipleOf':4,'minimum':-8}", GOOD("-8", "-4", "0", "400"),
            BAD("-12", "-2", "6"));
    check_q("{'type':'number','multipleOf':2}", GOOD("4", "-6"), BAD("3", "4.5"));
    check_q("{'multipleOf':1,'type':'number'}", GOOD("4", "0"), BAD("0.5"));
    refused("{\"type\":\"integer\",\"multipleOf\":2,\"maximum\":1e9}",
            "/multipleOf: not supported beside these bounds (more than 1000 multiples, or a lower "
            "bound above multipleOf)");
    refused("{\"type\":\"integer\",\"multipleOf\":3,\"minimum\":1,\"maximum\":2}",
            "/multipleOf: no multiple within the bounds");
}

/* contains, and the complements of items and contains it gives */
static void test_contains(void **state)
{
    (void)state;
    check_q("{'type':'array','contains':{'const':3}}", GOOD("[3]", "[1,3]", "[3,1,2]", "[ 1 , 3 ]"),
            BAD("[]", "[1,2]"));
    check_q("{'type':'array','items':{'type':'integer'},'contains':{'minimum':5}}",
            GOOD("[1,5]", "[7]", "[9,1,2]"), BAD("[1,2]", "[5,'a']", "[]"));
    check_q("{'type':'array','not':{'items':{'type':'string'}}}", GOOD("[1]", "['a',2]"),
            BAD("[]", "['a']", "['a','b']"));
    check_q("{'oneOf':[{'type':'array','items':{'type':'string'}},{'type':'array','items':{'type':"
            "'integer'}}]}",
            GOOD("['a']", "[1]"), BAD("[]", "['a',1]"));
    check_q("{'type':'array','not':{'contains':{'const':'x'}}}", GOOD("['a']", "[]", "[1]"),
            BAD("['x']", "['a','x']"));
    /* a merge that leaves no value (minLength above maxLength) drops that alternative; a schema
     * with none left is refused */
    refused("{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":2},"
            "\"contains\":{\"minLength\":3}}",
            "/contains/minLength: greater than maxLength");
    check_q("{'anyOf':[{'type':'string','maxLength':1,'minLength':2},{'type':'integer'}]}",
            GOOD("1"), BAD("'a'"));
    refused("{\"contains\":{},\"maxItems\":3}",
            "/contains: not supported beside tuple items, maxItems or minItems above 1");
}

/* Additional-property keys in json.dumps's spelling only, defined names excluded whatever they
 * need escaped; positional items are not merged with another schema's items. Both found by the
 * JSON-Schema-Test-Suite (tests/cli/test_json_schema_suite.sh). */
static void test_suite_regressions(void **state)
{
    (void)state;
    check("{\"properties\":{\"foo\\nbar\":{\"type\":\"number\"},\"a\":{\"type\":\"number\"}}}",
          GOOD("{\"foo\\nbar\":1}", "{\"x\":\"s\"}", "{\"a\":1,\"foo\\tbar\":\"s\"}"),
          BAD("{\"foo\\nbar\":\"1\"}", "{\"a\":1,\"foo\\nbar\":\"1\"}", "{\"\\u0061\":\"s\"}"));
    check("{\"dependentRequired\":{\"foo\\rbar\":[\"x\"]}}",
          GOOD("{}", "{\"foo\\rbar\":1,\"x\":2}"), BAD("{\"foo\\rbar\":1}"));
    /* \s is ECMA-262's white space: U+00A0, U+2028, U+3000 too, so \S excludes them */
    check("{\"pattern\":\"^\\\\S+$\"}", GOOD("\"ab\"", "\"\xc3\xa9\""),
          BAD("\"a\xc2\xa0"
              "b\"",
              "\"a\xe2\x80\xa8\"", "\"\xe3\x80\x80\"", "\"a b\""));
    check("{\"pattern\":\"^\\\\s$\"}", GOOD("\"\xc2\xa0\"", "\" \"", "\"\\n\""), BAD("\"a\""));
    refused("{\"allOf\":[{\"prefixItems\":[{\"minimum\":3}]}],\"items\":{\"minimum\":5}}",
            "/allOf/0: allOf: positional items cannot be merged with items");
}

static void test_refused_keywords(void **state)
{
    (void)state;
    refused("{\"properties\":{\"a\":{\"propertyNames\":{}}}}",
            "/properties/a/propertyNames: not supported");
    refused("{\"not\":{\"additionalProperties\":false}}",
            "/not/additionalProperties: not supported in a negation (oneOf, if, not)");
    refused("{\"items\":{\"uniqueItems\":true}}",
            "/items/uniqueItems: items must be an enum, a const, booleans or null");
    refused("{\"anyOf\":[{\"multipleOf\":0.5}]}",
            "/anyOf/0/multipleOf: not supported (only integers up to 1000; a decimal one is "
            "compared in floating point by validators)");
    refused("{\"$defs\":{\"a/b\":{\"minContains\":1}},\"$ref\":\"#/$defs/a~1b\"}",
            "/$defs/a~1b/minContains: not supported");
    refused("{\"type\":\"strin\"}", "/type: unknown type 'strin'");
    refused("{\"minItems\":-1}", "/minItems: must be a non-negative integer");
    /* counts over the grammar's repetition limit: named by pointer, never by a generated rule */
    refused("{\"type\":\"array\",\"minItems\":20000000}",
            "/minItems: 20000000 is above the limit of 10000000");
    refused("{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":900000000}}",
            "/items/maxLength: 900000000 is above the limit of 10000000");
    refused("{\"type\":\"string\",\"pattern\":\"a{20000}\"}",
            "/pattern: repetition count 20000 is above the limit of 10000 (at offset 7)");
    refused("false", "/: the schema false allows no value");
    refused("{\"type\":", "invalid JSON at line 1, column 8: unexpected token near end of file");
    /* annotations and unknown keywords are ignored */
    check(
        "{\"title\":\"t\",\"description\":\"d\",\"examples\":[1],\"x-foo\":1,\"uniqueItems\":false,"
        "\"type\":\"integer\"}",
        GOOD("1"), BAD("\"a\""));
}

static void test_rule_prefix_and_json_object(void **state)
{
    (void)state;
    tdm_buf_t out = TDM_BUF_INIT;
    tdm_error_t err;
    const char *a =
        "{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"integer\"}},\"required\":[\"x\"]}";
    const char *b = "{\"type\":\"string\",\"minLength\":1}";
    assert_int_equal(tdm_json_schema_to_gbnf_rule(a, strlen(a), "call-0", &out, &err), 0);
    assert_int_equal(tdm_json_schema_to_gbnf_rule(b, strlen(b), "call-1", &out, &err), 0);
    tdm_buf_puts(&out, "root ::= \"<a>\" call-0 \"</a>\" | \"<b>\" call-1 \"</b>\"\n");
    assert_null(strstr(out.data, "root-"));
    tdm_grammar_t *g = tdm_grammar_parse(out.data, out.len, NULL, &err);
    assert_non_null(g);
    assert_true(grammar_accepts(g, "<a>{\"x\":1}</a>"));
    assert_true(grammar_accepts(g, "<b>\"s\"</b>"));
    assert_false(grammar_accepts(g, "<b>\"\"</b>"));
    tdm_grammar_destroy(&g);
    tdm_buf_free(&out);
    assert_int_equal(tdm_json_schema_to_gbnf_rule(a, strlen(a), "bad name", &out, &err),
                     TDM_EINVALID);
    assert_int_equal(tdm_json_object_gbnf(&out, &err), 0);
    g = tdm_grammar_parse(out.data, out.len, NULL, &err);
    assert_non_null(g);
    assert_true(grammar_accepts(g, "{}"));
    assert_true(grammar_accepts(g, "{\"a\": [1, {\"b\": null}]}"));
    assert_false(grammar_accepts(g, "[]"));
    tdm_grammar_destroy(&g);
    tdm_buf_free(&out);
}

/* Compiles a regex constraint (raw mode) into rule `root`. */
static tdm_grammar_t *compile_regex(const char *re)
{
    tdm_buf_t out = TDM_BUF_INIT;
    tdm_error_t err;
    if (tdm_regex_to_gbnf_rule(re, strlen(re), "root", &out, &err) != 0)
        fail_msg("regex %s: %s", re, err.msg);
    tdm_grammar_t *g = tdm_grammar_parse(out.data, out.len, NULL, &err);
    if (!g)
        fail_msg("regex %s: GBNF does not parse: %s\n%s", re, err.msg, out.data);
    tdm_buf_free(&out);
    return g;
}

static void check_regex(const char *re, const char *const *good, const char *const *bad)
{
    tdm_grammar_t *g = compile_regex(re);
    for (; good && *good; good++)
        if (!grammar_accepts(g, *good))
            fail_msg("regex %s should accept %s", re, *good);
    for (; bad && *bad; bad++)
        if (grammar_accepts(g, *bad))
            fail_msg("regex %s should reject %s", re, *bad);
    tdm_grammar_destroy(&g);
}

static void test_regex(void **state)
{
    (void)state;
    /* whole-text match; anchors at the ends change nothing */
    check_regex("[a-c]+x?", GOOD("a", "abcx", "cc"), BAD("", "abd", "xa"));
    check_regex("^(\\d{3})-(?:\\d{2}|[A-Z]{2})$", GOOD("123-45", "123-AB"), BAD("123-4", "12-45"));
    check_regex("a.c",
                GOOD("abc", "a\"c",
                     "a\xc3\xa9"
                     "c"),
                BAD("a\nc", "ac"));
    check_regex("[^\\s\\]]{2,}", GOOD("ab", "a-b"), BAD("a b", "a]", "a"));
    check_regex("\\w+@\\w+\\.com", GOOD("a_1@b.com"), BAD("a@b.org"));
    check_regex("(?<year>19|20)\\d\\d|never", GOOD("1999", "2024", "never"), BAD("1800", "nev"));
    check_regex("a{2}b{1,}c{0,2}?", GOOD("aab", "aabbbcc"), BAD("ab", "aabccc"));
    check_regex("[\\x41-\\u0043\\-]\\u00e9", GOOD("A\xc3\xa9", "-\xc3\xa9"), BAD("D\xc3\xa9"));
    check_regex("(a|)b", GOOD("ab", "b"), BAD("aab"));

    tdm_buf_t out = TDM_BUF_INIT;
    tdm_error_t err;
    static const struct {
        const char *re, *msg;
    } bad[] = {
        {"a(?!b)", "regex: group kind not supported (lookahead, flags, ...) (at offset 3)"},
        {"\\bword", "regex: \\b (word boundary) not supported (at offset 2)"},
        {"(a", "regex: missing ) (at offset 2)"},
        {"a)", "regex: unmatched ) (at offset 1)"},
        {"*a", "regex: nothing to repeat (at offset 0)"},
        {"a**", "regex: nothing to repeat (at offset 2)"},
        {"[b-a]", "regex: bad range in character class (at offset 4)"},
        {"[abc", "regex: unterminated character class (at offset 4)"},
        {"a{3,2}", "regex: bad {m,n} quantifier (at offset 5)"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(tdm_regex_to_gbnf_rule(bad[i].re, strlen(bad[i].re), "root", &out, &err),
                         TDM_EINVALID);
        assert_string_equal(err.msg, bad[i].msg);
    }
    assert_int_equal(tdm_regex_to_gbnf_rule("a", 1, "", &out, &err), TDM_EINVALID);
    tdm_buf_free(&out);
}

static void test_choice(void **state)
{
    (void)state;
    const char *const choices[] = {"yes", "no", "say \"hi\"\n", "caf\xc3\xa9"};
    tdm_buf_t out = TDM_BUF_INIT;
    tdm_error_t err;
    assert_int_equal(tdm_choice_to_gbnf(choices, 4, &out, &err), 0);
    tdm_grammar_t *g = tdm_grammar_parse(out.data, out.len, NULL, &err);
    assert_non_null(g);
    for (int i = 0; i < 4; i++)
        assert_true(grammar_accepts(g, choices[i]));
    assert_false(grammar_accepts(g, "ye"));
    assert_false(grammar_accepts(g, "\"yes\""));
    tdm_grammar_destroy(&g);
    assert_int_equal(tdm_choice_to_gbnf(choices, 0, &out, &err), TDM_EINVALID);
    assert_string_equal(err.msg, "choice: the list is empty");
    const char *const bad_utf8[] = {"ok", "\xff"};
    assert_int_equal(tdm_choice_to_gbnf(bad_utf8, 2, &out, &err), TDM_EINVALID);
    assert_string_equal(err.msg, "choice: entry 1 is not UTF-8");
    tdm_buf_free(&out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_types),
        cmocka_unit_test(test_whitespace),
        cmocka_unit_test(test_properties_required_order),
        cmocka_unit_test(test_additional_properties),
        cmocka_unit_test(test_pattern_properties),
        cmocka_unit_test(test_arrays),
        cmocka_unit_test(test_enum_const),
        cmocka_unit_test(test_enum_trie),
        cmocka_unit_test(test_any_one_all_of),
        cmocka_unit_test(test_all_of_conditionals),
        cmocka_unit_test(test_merged_property_order),
        cmocka_unit_test(test_refs),
        cmocka_unit_test(test_ref_anchors),
        cmocka_unit_test(test_string_lengths_and_pattern),
        cmocka_unit_test(test_formats),
        cmocka_unit_test(test_formats_regex),
        cmocka_unit_test(test_bounds_random),
        cmocka_unit_test(test_dependent_required),
        cmocka_unit_test(test_not_type),
        cmocka_unit_test(test_integer_bounds),
        cmocka_unit_test(test_number_bounds),
        cmocka_unit_test(test_not_forms),
        cmocka_unit_test(test_if_then_else),
        cmocka_unit_test(test_grammar_size_limit),
        cmocka_unit_test(test_unique_items),
        cmocka_unit_test(test_multiple_of),
        cmocka_unit_test(test_contains),
        cmocka_unit_test(test_suite_regressions),
        cmocka_unit_test(test_refused_keywords),
        cmocka_unit_test(test_rule_prefix_and_json_object),
        cmocka_unit_test(test_regex),
        cmocka_unit_test(test_choice),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
