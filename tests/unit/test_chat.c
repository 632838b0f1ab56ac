/* test_chat.c - the chat templates' tool calling (tdm_chat_apply_tools, the Hermes format):
 * the exact text of tool definitions, assistant tool calls and tool results for ChatML,
 * Llama-3 and Gemma, Llama-2's refusal, and bad tool JSON; and the Gemma template: Jinja's
 * renderings of Gemma 3's template (tests/golden/gemma3_tokenizer.json, no model needed) byte
 * for byte, its role alternation, and its choice for Gemma files without a template. (The
 * other templates without tools are checked against Jinja's renderings in
 * test_tokenizer_smollm2.c.) */
#include "tdm_test.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/chat.h"
#include "tandem/gguf.h"

#define GEMMA3_GOLDEN TDM_SOURCE_DIR "/tests/golden/gemma3_tokenizer.json"

#define TOOLS                                                                                      \
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather "    \
    "now\",\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},"   \
    "\"required\":[\"city\"]}}}]"

/* What Qwen2.5's template (transformers' apply_chat_template) writes for TOOLS. */
#define TOOLS_TEXT                                                                                 \
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "     \
    "provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": "     \
    "\"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather now\", "   \
    "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, "  \
    "\"required\": [\"city\"]}}}\n</tools>\n\nFor each function call, return a json object "       \
    "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"     \
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"

static const tdm_chat_message_t conversation[] = {
    {.role = "user", .content = "Weather in Paris and Rome?"},
    {.role = "assistant",
     .content = NULL,
     .tool_calls = "[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":"
                   "\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\"}},{\"id\":"
                   "\"call_2\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
                   "\"arguments\":\"{\\\"city\\\": \\\"Rome\\\"}\"}}]"},
    {.role = "tool", .content = "22 C", .tool_call_id = "call_1"},
    {.role = "tool", .content = "25 C", .tool_call_id = "call_2", .name = "get_weather"},
    {.role = "assistant", .content = "Warm in both.", .tool_calls = ""},
};

#define CALLS_TEXT                                                                                 \
    "\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"           \
    "</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "            \
    "\"Rome\"}}\n</tool_call>"

static void expect_render(tdm_chat_template_t t, const tdm_chat_message_t *msgs, size_t n,
                          const char *tools, const char *def, const char *want)
{
    char *out = NULL;
    size_t len = 0;
    tdm_error_t err = {0};
    int rc = tdm_chat_apply_tools(t, msgs, n, tools, true, def, &out, &len, &err);
    if (rc != TDM_OK)
        fail_msg("render failed: %s", err.msg);
    assert_string_equal(out, want);
    assert_int_equal(len, strlen(want));
    free(out);
}

static void test_chatml_tools(void **state)
{
    (void)state;
    /* the default system message comes first, then the tools */
    expect_render(TDM_CHAT_TEMPLATE_CHATML, conversation, 5, TOOLS, "You are SmolLM.",
                  "<|im_start|>system\nYou are SmolLM.\n\n" TOOLS_TEXT "<|im_end|>\n"
                  "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
                  "<|im_start|>assistant" CALLS_TEXT "<|im_end|>\n"
                  "<|im_start|>user\n<tool_response>\n22 C\n</tool_response>\n<tool_response>\n"
                  "25 C\n</tool_response><|im_end|>\n"
                  "<|im_start|>assistant\nWarm in both.<|im_end|>\n"
                  "<|im_start|>assistant\n");
    /* an explicit system message takes the default's place; no system text at all */
    const tdm_chat_message_t sys[] = {{.role = "system", .content = "Be brief."},
                                      {.role = "user", .content = "hi"}};
    expect_render(TDM_CHAT_TEMPLATE_CHATML, sys, 2, TOOLS, "You are SmolLM.",
                  "<|im_start|>system\nBe brief.\n\n" TOOLS_TEXT "<|im_end|>\n"
                  "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    expect_render(TDM_CHAT_TEMPLATE_CHATML, sys + 1, 1, TOOLS, NULL,
                  "<|im_start|>system\n" TOOLS_TEXT "<|im_end|>\n"
                  "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    /* tool calls and results without tool definitions; content before the calls */
    const tdm_chat_message_t calls[] = {
        {.role = "user", .content = "x"},
        {.role = "assistant",
         .content = "Checking.",
         .tool_calls = "[{\"function\":{\"name\":\"f\",\"arguments\":\"not json\"}}]"},
        {.role = "tool", .content = "ok", .tool_call_id = "1"}};
    expect_render(TDM_CHAT_TEMPLATE_CHATML, calls, 3, NULL, NULL,
                  "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\nChecking.\n<tool_call>\n"
                  "{\"name\": \"f\", \"arguments\": \"not json\"}\n</tool_call><|im_end|>\n"
                  "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
                  "<|im_start|>assistant\n");
    /* "" tools is no tools: the rendering without tools, byte for byte */
    expect_render(TDM_CHAT_TEMPLATE_CHATML, sys, 2, "", NULL,
                  "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                  "<|im_start|>assistant\n");
}

static void test_llama3_tools(void **state)
{
    (void)state;
    expect_render(TDM_CHAT_TEMPLATE_LLAMA3, conversation, 5, TOOLS, NULL,
                  "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n" TOOLS_TEXT
                  "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWeather in Paris and "
                  "Rome?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<tool_call>\n"
                  "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
                  "</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                  "{\"city\": \"Rome\"}}\n</tool_call><|eot_id|><|start_header_id|>user"
                  "<|end_header_id|>\n\n<tool_response>\n22 C\n</tool_response>\n"
                  "<tool_response>\n25 C\n</tool_response><|eot_id|><|start_header_id|>"
                  "assistant<|end_header_id|>\n\nWarm in both.<|eot_id|><|start_header_id|>"
                  "assistant<|end_header_id|>\n\n");
}

static void expect_error(tdm_chat_template_t t, const tdm_chat_message_t *msgs, size_t n,
                         const char *tools, const char *want)
{
    char *out = (char *)"x";
    tdm_error_t err = {0};
    assert_int_equal(tdm_chat_apply_tools(t, msgs, n, tools, true, NULL, &out, NULL, &err),
                     TDM_EINVALID);
    assert_null(out);
    if (!strstr(err.msg, want))
        fail_msg("message \"%s\" lacks \"%s\"", err.msg, want);
}

static void test_tool_errors(void **state)
{
    (void)state;
    const tdm_chat_message_t user[] = {{.role = "user", .content = "hi"}};
    expect_error(TDM_CHAT_TEMPLATE_LLAMA2, user, 1, TOOLS, "llama2");
    expect_error(TDM_CHAT_TEMPLATE_LLAMA2, conversation, 3, NULL, "llama2");
    expect_error(TDM_CHAT_TEMPLATE_CHATML, user, 1, "{\"a\": 1}", "tools must be a JSON array");
    expect_error(TDM_CHAT_TEMPLATE_CHATML, user, 1, "[1]", "tools[0]");
    expect_error(TDM_CHAT_TEMPLATE_CHATML, user, 1, "[{", "tools must be a JSON array");
    const tdm_chat_message_t bad_calls[] = {
        {.role = "user", .content = "hi"},
        {.role = "assistant", .content = NULL, .tool_calls = "[{\"function\": {}}]"}};
    expect_error(TDM_CHAT_TEMPLATE_CHATML, bad_calls, 2, NULL, "message 1: tool_calls[0]");
    const tdm_chat_message_t user_calls[] = {{.role = "user", .content = "hi", .tool_calls = "[]"}};
    expect_error(TDM_CHAT_TEMPLATE_CHATML, user_calls, 1, NULL, "only assistant");
    const tdm_chat_message_t no_content[] = {{.role = "assistant", .content = NULL}};
    expect_error(TDM_CHAT_TEMPLATE_CHATML, no_content, 1, NULL, "no content");
}

static void test_gemma_tools(void **state)
{
    (void)state;
    /* no system message: the tools block alone opens the first user turn */
    expect_render(TDM_CHAT_TEMPLATE_GEMMA, conversation, 5, TOOLS, NULL,
                  "<bos><start_of_turn>user\n" TOOLS_TEXT "\n\nWeather in Paris and Rome?"
                  "<end_of_turn>\n<start_of_turn>model\n<tool_call>\n{\"name\": "
                  "\"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
                  "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                  "\"Rome\"}}\n</tool_call><end_of_turn>\n<start_of_turn>user\n"
                  "<tool_response>\n22 C\n</tool_response>\n<tool_response>\n25 C\n"
                  "</tool_response><end_of_turn>\n<start_of_turn>model\nWarm in both."
                  "<end_of_turn>\n<start_of_turn>model\n");
    /* a system message comes before the tools, both before the first user text */
    const tdm_chat_message_t sys[] = {{.role = "system", .content = "Be brief."},
                                      {.role = "user", .content = " hi "}};
    expect_render(TDM_CHAT_TEMPLATE_GEMMA, sys, 2, TOOLS, NULL,
                  "<bos><start_of_turn>user\nBe brief.\n\n" TOOLS_TEXT "\n\nhi<end_of_turn>\n"
                  "<start_of_turn>model\n");
}

/* ---- the Gemma template ---- */

/* Jinja's renderings of Gemma 3's template, byte for byte. */
static void test_gemma_golden(void **state)
{
    (void)state;
    json_error_t jerr;
    json_t *golden = json_load_file(GEMMA3_GOLDEN, 0, &jerr);
    if (!golden)
        fail_msg("%s:%d: %s", GEMMA3_GOLDEN, jerr.line, jerr.text);
    const json_t *chats = json_object_get(golden, "chat");
    assert_true(json_array_size(chats) >= 10);
    size_t failed = 0;
    for (size_t i = 0; i < json_array_size(chats); i++) {
        const json_t *c = json_array_get(chats, i);
        tdm_chat_template_t t;
        assert_int_equal(tdm_chat_template_from_name(
                             json_string_value(json_object_get(c, "template")), &t, NULL),
                         TDM_OK);
        const json_t *jm = json_object_get(c, "messages");
        size_t n = json_array_size(jm);
        tdm_chat_message_t msgs[8];
        assert_true(n <= 8);
        for (size_t k = 0; k < n; k++) {
            const json_t *m = json_array_get(jm, k);
            msgs[k] =
                (tdm_chat_message_t){.role = json_string_value(json_object_get(m, "role")),
                                     .content = json_string_value(json_object_get(m, "content"))};
        }
        bool gen = json_is_true(json_object_get(c, "add_generation_prompt"));
        const char *want = json_string_value(json_object_get(c, "text"));
        char *text = NULL;
        size_t len = 0;
        tdm_error_t err = {0};
        if (tdm_chat_apply(t, msgs, n, gen, NULL, &text, &len, &err) != TDM_OK) {
            failed++;
            fprintf(stderr, "chat %zu: apply failed: %s\n", i, err.msg);
            continue;
        }
        if (len != json_string_length(json_object_get(c, "text")) || strcmp(text, want) != 0) {
            failed++;
            fprintf(stderr, "chat %zu:\n  want \"%s\"\n  got  \"%s\"\n", i, want, text);
        }
        free(text);
    }
    json_decref(golden);
    if (failed)
        fail_msg("%zu Gemma renderings differ from Jinja's (listed above)", failed);
}

static void test_gemma_rules(void **state)
{
    (void)state;
    const tdm_chat_message_t two_users[] = {{.role = "system", .content = "s"},
                                            {.role = "user", .content = "a"},
                                            {.role = "user", .content = "b"}};
    expect_error(TDM_CHAT_TEMPLATE_GEMMA, two_users, 3, NULL, "message 2 has role 'user'");
    expect_error(TDM_CHAT_TEMPLATE_GEMMA, two_users, 3, NULL, "gemma");
    const tdm_chat_message_t model_first[] = {{.role = "assistant", .content = "a"}};
    expect_error(TDM_CHAT_TEMPLATE_GEMMA, model_first, 1, NULL, "message 0");
    const tdm_chat_message_t tool_after_user[] = {{.role = "user", .content = "a"},
                                                  {.role = "tool", .content = "r"}};
    expect_error(TDM_CHAT_TEMPLATE_GEMMA, tool_after_user, 2, NULL, "alternate");
    /* no messages: BOS and the generation prompt (Gemma's Jinja template refuses []); a
     * default system message opens the first user turn as an explicit one does */
    expect_render(TDM_CHAT_TEMPLATE_GEMMA, NULL, 0, NULL, "ignored", "<bos><start_of_turn>model\n");
    const tdm_chat_message_t user[] = {{.role = "user", .content = "hi"}};
    expect_render(TDM_CHAT_TEMPLATE_GEMMA, user, 1, NULL, "Be kind.",
                  "<bos><start_of_turn>user\nBe kind.\n\nhi<end_of_turn>\n"
                  "<start_of_turn>model\n");
    tdm_chat_template_t t;
    tdm_error_t err = {0};
    assert_int_equal(tdm_chat_template_from_name("gemma", &t, &err), TDM_OK);
    assert_int_equal(t, TDM_CHAT_TEMPLATE_GEMMA);
    assert_string_equal(tdm_chat_template_name(t), "gemma");
    assert_true(tdm_chat_template_writes_bos(t));
    assert_int_equal(tdm_chat_template_from_name("gemma3", &t, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "gemma"));
}

/* An in-memory GGUF with general.architecture arch and, when tpl is not NULL, a template. */
static tdm_gguf_t *gguf_of(const char *arch, const char *tpl, void **buf)
{
    tdm_gguf_writer_t *w = tdm_gguf_writer_new();
    assert_non_null(w);
    assert_int_equal(tdm_gguf_writer_set_str(w, "general.architecture", arch), 0);
    if (tpl)
        assert_int_equal(tdm_gguf_writer_set_str(w, "tokenizer.chat_template", tpl), 0);
    size_t size;
    assert_int_equal(tdm_gguf_writer_to_memory(w, buf, &size), 0);
    tdm_gguf_writer_destroy(&w);
    tdm_gguf_t *g = tdm_gguf_open_memory(*buf, size, NULL);
    assert_non_null(g);
    return g;
}

/* Gemma files without a template get Gemma's; other architectures still need one named. */
static void test_gemma_detect(void **state)
{
    (void)state;
    const char *const archs[] = {"gemma", "gemma2", "gemma3"};
    for (size_t i = 0; i < 3; i++) {
        void *buf = NULL;
        tdm_gguf_t *g = gguf_of(archs[i], NULL, &buf);
        tdm_chat_template_t t = TDM_CHAT_TEMPLATE_CHATML;
        char def[16] = "unchanged";
        assert_int_equal(tdm_chat_template_detect(g, &t, def, sizeof def, NULL), TDM_OK);
        assert_int_equal(t, TDM_CHAT_TEMPLATE_GEMMA);
        assert_string_equal(def, "");
        tdm_chat_pick_t pick;
        assert_int_equal(tdm_chat_template_pick(g, NULL, NULL, &pick, NULL), TDM_OK);
        assert_int_equal(pick.tmpl, TDM_CHAT_TEMPLATE_GEMMA);
        tdm_gguf_destroy(&g);
        free(buf);
    }
    void *buf = NULL;
    tdm_gguf_t *g = gguf_of("llama", NULL, &buf);
    tdm_chat_template_t t;
    tdm_error_t err = {0};
    assert_int_equal(tdm_chat_template_detect(g, &t, NULL, 0, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "chatml|llama3|llama2|gemma"));
    tdm_gguf_destroy(&g);
    free(buf);
    /* a Gemma file's own template wins over the architecture */
    g = gguf_of("gemma3", "{{ '<|im_start|>' }}", &buf);
    assert_int_equal(tdm_chat_template_detect(g, &t, NULL, 0, NULL), TDM_OK);
    assert_int_equal(t, TDM_CHAT_TEMPLATE_CHATML);
    tdm_gguf_destroy(&g);
    free(buf);
}

/* Renders src (compiled as transformers compiles) with in; returns the heap output or NULL
 * with *err set. */
static char *jinja_render(const char *src, const tdm_chat_jinja_input_t *in, bool *raised,
                          tdm_error_t *err)
{
    tdm_jinja_t *t = tdm_chat_jinja_compile(src, strlen(src), err);
    assert_non_null(t);
    char *out = NULL;
    int rc = tdm_chat_apply_jinja(t, in, &out, NULL, raised, err);
    tdm_jinja_destroy(&t);
    assert_int_equal(rc == TDM_OK, out != NULL);
    return out;
}

/* The variables a Jinja template sees: messages with tool-call arguments parsed into objects,
 * tools, bos/eos, add_generation_prompt, kwargs merged over them; the errors. */
static void test_jinja_inputs(void **state)
{
    (void)state;
    const tdm_chat_message_t msgs[] = {
        {.role = "user", .content = "Weather?"},
        {.role = "assistant",
         .tool_calls = "[{\"id\": \"c1\", \"type\": \"function\", \"function\": {\"name\": "
                       "\"w\", \"arguments\": \"{\\\"city\\\": \\\"Oslo\\\", \\\"n\\\": 3}\"}}]"},
        {.role = "tool", .content = "snow", .tool_call_id = "c1"}};
    json_t *kw = json_pack("{s:b, s:s}", "enable_thinking", 0, "bos_token", "<B>");
    tdm_chat_jinja_input_t in = {.msgs = msgs,
                                 .n = 3,
                                 .tools =
                                     "[{\"type\": \"function\", \"function\": {\"name\": \"w\"}}]",
                                 .add_generation_prompt = true,
                                 .bos_token = "<s>",
                                 .eos_token = "</s>",
                                 .kwargs = kw,
                                 .now = 86400};
    tdm_error_t err = {0};
    bool raised = true;
    char *out = jinja_render(
        "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments | tojson }}"
        "{{ m.tool_calls[0].function.arguments.city }}{% endif %}{{ m.tool_call_id }};"
        "{% endfor %}{{ tools[0].function.name }}{{ eos_token }}{{ add_generation_prompt }}"
        "{{ enable_thinking }}{{ documents is none }}{{ strftime_now('%d') }}",
        &in, &raised, &err);
    assert_non_null(out);
    assert_false(raised);
    assert_string_equal(out, "<B>user:Weather?;assistant:None{\"city\": \"Oslo\", \"n\": 3}Oslo;"
                             "tool:snowc1;w</s>TrueFalseTrue02");
    free(out);

    /* raise_exception's message exactly; other failures with line:column */
    in.kwargs = NULL;
    assert_null(
        jinja_render("{{ raise_exception('no ' + messages[0].role) }}", &in, &raised, &err));
    assert_true(raised);
    assert_int_equal(err.code, TDM_EINVALID);
    assert_string_equal(err.msg, "no user");
    assert_null(jinja_render("x\n{{ messages[0].content + 1 }}", &in, &raised, &err));
    assert_false(raised);
    assert_int_equal(err.code, TDM_EINVALID);
    assert_non_null(strstr(err.msg, "chat template: 2:"));
    /* a render limit is the template's fault too: 400, not 429 */
    assert_null(
        jinja_render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", &in, &raised, &err));
    assert_int_equal(err.code, TDM_EINVALID);
    if (!strstr(err.msg, "1:"))
        fail_msg("%s", err.msg);

    /* kwargs must be an object and may not replace messages or tools */
    json_t *bad = json_pack("{s:[]}", "messages");
    in.kwargs = bad;
    assert_null(jinja_render("x", &in, NULL, &err));
    assert_string_equal(err.msg, "chat_template_kwargs.messages: is set by the request's own "
                                 "messages field");
    json_decref(bad);
    bad = json_array();
    in.kwargs = bad;
    assert_null(jinja_render("x", &in, NULL, &err));
    assert_string_equal(err.msg, "chat_template_kwargs: must be a JSON object");
    json_decref(bad);
    in.kwargs = NULL;
    in.tools = "{}";
    assert_null(jinja_render("x", &in, NULL, &err));
    assert_string_equal(err.msg, "tools: not a JSON array of tools");
    in.tools = NULL;
    const tdm_chat_message_t robot[] = {{.role = "robot", .content = "x"}};
    in.msgs = robot;
    in.n = 1;
    assert_null(jinja_render("x", &in, NULL, &err));
    assert_non_null(strstr(err.msg, "message 0 has role 'robot'"));
    json_decref(kw);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chatml_tools), cmocka_unit_test(test_llama3_tools),
        cmocka_unit_test(test_tool_errors),  cmocka_unit_test(test_gemma_tools),
        cmocka_unit_test(test_gemma_golden), cmocka_unit_test(test_gemma_rules),
        cmocka_unit_test(test_gemma_detect), cmocka_unit_test(test_jinja_inputs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
