/* test_chat.c - the chat templates' tool calling (tdm_chat_apply_tools, the Hermes format):
 * the exact text of tool definitions, assistant tool calls and tool results for ChatML and
 * Llama-3, Llama-2's refusal, and bad tool JSON. (The templates without tools are checked
 * against Jinja's renderings in test_tokenizer_smollm2.c.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tandem/chat.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chatml_tools),
        cmocka_unit_test(test_llama3_tools),
        cmocka_unit_test(test_tool_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
