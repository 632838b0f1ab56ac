/* fuzz_jinja.c - libFuzzer target for the Jinja renderer (tandem/jinja.h): the input is
 * compiled as a template and, when it compiles, rendered over a fixed chat context (messages
 * with a tool call and a tool result, tools, bos/eos tokens) under small render limits.
 *
 * Input layout: byte 0 holds flags (bit 0: trim_blocks, bit 1: lstrip_blocks, bit 2:
 * add_generation_prompt); the rest is the template source. The seeds in tests/fuzz/corpus/jinja/
 * are real chat templates (llama.cpp's models/templates) with flags 0x07, as transformers sets
 * them. Invariants checked: a failed compile or render sets an error message and no output; a
 * rendering stays within its output limit and is NUL-terminated at its length. */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/jinja.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* An invariant of the renderer does not hold: crash so libFuzzer keeps the input. */
#define FUZZ_CHECK(cond)                                                                           \
    do {                                                                                           \
        if (!(cond))                                                                               \
            __builtin_trap();                                                                      \
    } while (0)

/* The context every template is rendered with: what apply_chat_template passes for a chat
 * with a tool call (jansson keeps it for the process; built once). */
static const char CONTEXT[] =
    "{\"messages\": ["
    "{\"role\": \"system\", \"content\": \"You can call tools.\"},"
    "{\"role\": \"user\", \"content\": \"Weather in Oslo?\"},"
    "{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"id\": \"call_1\", "
    "\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"arguments\": "
    "{\"city\": \"Oslo\", \"days\": 3, \"scale\": 1.5, \"extra\": [true, null]}}}]},"
    "{\"role\": \"tool\", \"tool_call_id\": \"call_1\", \"content\": \"snow\"},"
    "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"And Rome?\"}]}],"
    "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
    "\"description\": \"Get the weather\", \"parameters\": {\"type\": \"object\", "
    "\"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}],"
    "\"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static json_t *context;
    if (!context)
        context = json_loads(CONTEXT, 0, NULL);
    FUZZ_CHECK(context != NULL);
    if (size < 1)
        return 0;
    tdm_jinja_options_t opt = {.trim_blocks = data[0] & 1, .lstrip_blocks = (data[0] >> 1) & 1};
    tdm_error_t err = {0};
    tdm_jinja_t *t = tdm_jinja_new((const char *)data + 1, size - 1, "fuzz", &opt, &err);
    if (!t) {
        FUZZ_CHECK(err.code != 0 && err.msg[0] != '\0');
        return 0;
    }
    json_object_set_new(context, "add_generation_prompt", json_boolean((data[0] >> 2) & 1));
    tdm_jinja_render_options_t ro = {
        .limits = {.max_output_bytes = 65536, .max_steps = 200000, .max_depth = 64}, .now = 0};
    char *out = NULL;
    size_t len = 0;
    bool raised = false;
    int rc = tdm_jinja_render(t, context, &ro, &out, &len, &raised, &err);
    if (rc == 0) {
        FUZZ_CHECK(out != NULL && len <= ro.limits.max_output_bytes && out[len] == '\0');
        free(out);
    } else {
        FUZZ_CHECK(out == NULL && err.msg[0] != '\0');
    }
    tdm_jinja_destroy(&t);
    FUZZ_CHECK(t == NULL);
    return 0;
}
