/* chat.h - chat templates: a list of chat messages -> the prompt text a model was trained on.
 *
 * Four families are built in and rendered in C, byte for byte as the models' own Jinja
 * templates render them (Hugging Face transformers' apply_chat_template):
 *  - ChatML (SmolLM2, Qwen, Hermes): "<|im_start|>ROLE\nCONTENT<|im_end|>\n" per message; when
 *    the first message is not a system message and the template has a default system message
 *    (SmolLM2: "You are a helpful AI assistant named SmolLM, trained by Hugging Face"), a system
 *    message with that text comes first. Contents are not trimmed.
 *  - Llama-3 (Meta-Llama-3-*-Instruct): "<|begin_of_text|>" once, then per message
 *    "<|start_header_id|>ROLE<|end_header_id|>\n\n" + trim(CONTENT) + "<|eot_id|>". The 3.1+
 *    templates' "Cutting Knowledge Date" system preamble and their JSON tool-call convention
 *    are not reproduced: tools use the Hermes format there too (tdm_chat_apply_tools).
 *  - Llama-2 (Llama-2-*-chat): "<s>[INST] <<SYS>>\nSYSTEM\n<</SYS>>\n\nUSER [/INST] ASSISTANT </s>"
 *    and "<s>[INST] USER [/INST]" for each later user turn; user and assistant turns strictly
 *    alternate (user first) and each turn is trimmed (the first one together with its <<SYS>>
 *    block, so its leading whitespace stays), as Meta's template does.
 *  - Gemma (gemma-3-*-it; Gemma 2's format without its system message refusal): "<bos>" once,
 *    then per message "<start_of_turn>ROLE\n" + trim(CONTENT) + "<end_of_turn>\n" with the
 *    assistant's role written "model"; no system turn: the system message's text (untrimmed)
 *    and "\n\n" open the first user turn. User and assistant turns strictly alternate (user
 *    first), as Gemma's template requires. Chosen for Gemma GGUFs without a template.
 * trim() removes leading and trailing whitespace as Python's str.strip() does (the characters
 * str.isspace() accepts: ASCII whitespace, U+001C..U+001F, U+0085, U+00A0, U+3000 and the other
 * Unicode spaces), since the templates call it.
 *
 * BOS: the Llama-3, Llama-2 and Gemma renderings contain the BOS token's text
 * ("<|begin_of_text|>", "<s>", "<bos>") themselves, so the text must be tokenized with
 * parse_special and WITHOUT adding BOS (add_bos = false), or the prompt starts with two BOS tokens;
 * tdm_chat_template_writes_bos() says which templates do this. ChatML renderings contain no BOS;
 * SmolLM2's tokenizer adds none either (tokenizer.ggml.add_bos_token = false). Hugging Face
 * tokenizes chat prompts with add_special_tokens=False, which is the same rule.
 *
 * All functions are pure: no state, safe from any thread.
 */
#ifndef TANDEM_CHAT_H
#define TANDEM_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#include "tandem/base.h"
#include "tandem/gguf.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_chat_template {
    TDM_CHAT_TEMPLATE_CHATML = 0, /* "chatml": <|im_start|>role\n…<|im_end|> */
    TDM_CHAT_TEMPLATE_LLAMA3 = 1, /* "llama3": <|start_header_id|>role<|end_header_id|> */
    TDM_CHAT_TEMPLATE_LLAMA2 = 2, /* "llama2": [INST] <<SYS>> … [/INST] */
    TDM_CHAT_TEMPLATE_GEMMA = 3,  /* "gemma": <start_of_turn>role\n…<end_of_turn> */
} tdm_chat_template_t;

/* The template names for messages: "chatml, llama3, llama2 or gemma", and as a choice in usage
 * text: "chatml|llama3|llama2|gemma". */
#define TDM_CHAT_TEMPLATE_NAMES "chatml, llama3, llama2 or gemma"
#define TDM_CHAT_TEMPLATE_NAMES_BAR "chatml|llama3|llama2|gemma"

/* One chat message. role is "system", "user", "assistant" or "tool"; every string is
 * NUL-terminated UTF-8 owned by the caller. Initialise with designated initializers
 * ({.role = "user", .content = "hi"}) so the tool fields stay NULL. */
typedef struct tdm_chat_message {
    const char *role;
    const char *content;      /* may be NULL only for an assistant message with tool_calls */
    const char *tool_calls;   /* assistant: NULL/"" or OpenAI's tool_calls, a JSON array text
                                 [{"id", "type": "function", "function": {"name", "arguments"}}]
                                 (arguments a JSON text in a string, or an object) */
    const char *tool_call_id; /* tool: NULL/"" or the id of the call this result answers */
    const char *name;         /* tool: NULL/"" or the function's name (not rendered) */
} tdm_chat_message_t;

/* A default_system buffer size, in bytes with the NUL, that holds the default system message
 * of every template we know of (SmolLM2's and Qwen2.5's have 68 bytes each). */
#define TDM_CHAT_DEFAULT_SYSTEM_MAX 4096

/* The name of a template as the config and the CLI spell it ("chatml", "llama3", "llama2",
 * "gemma"); "?" for a value outside the enum. Cannot fail. */
const char *tdm_chat_template_name(tdm_chat_template_t t);

/* Parses a template name: "chatml", "llama3", "llama2" or "gemma" (exact, lower case).
 * Returns 0 with *out set, or TDM_EINVALID (name NULL or unknown; the message lists the
 * accepted names). */
int tdm_chat_template_from_name(const char *name, tdm_chat_template_t *out, tdm_error_t *err);

/* Recognises the family of the Jinja template in the model's tokenizer.chat_template by its
 * markers: "<|im_start|>" is ChatML, "<|start_header_id|>" is Llama-3, "[INST]" together with
 * "<<SYS>>" is Llama-2 (Mistral's [INST] template without <<SYS>> renders differently and is
 * not recognised), "<start_of_turn>" is Gemma. A model without tokenizer.chat_template whose
 * general.architecture is gemma, gemma2 or gemma3 is Gemma too (llama.cpp's converter writes
 * none for gemma-3-270m). When default_system is not NULL (cap > 0 bytes), it receives the
 * template's default system message (NUL-terminated; "" when the template has none): for
 * ChatML the text of a string literal "<|im_start|>system\n…<|im_end|>" in the template, with
 * Jinja's string escapes (\n, \t, \r, \\, \', \", \xHH, \uHHHH) decoded; Llama-3 and Llama-2
 * templates give "".
 * Returns 0 with *out set, or: TDM_EINVALID when the key is missing (and the architecture is
 * not Gemma's), not a string, or no family matches (the message names the settings that
 * choose one: config `model.chat_template: chatml|llama3|llama2|gemma`, CLI
 * `--chat-template`); TDM_ERESOURCE when the
 * default system message does not fit in cap bytes (or on out of memory). On error *out and
 * default_system are left unspecified. Borrows g; keeps nothing. */
int tdm_chat_template_detect(const tdm_gguf_t *g, tdm_chat_template_t *out, char *default_system,
                             size_t cap, tdm_error_t *err);

/* True when template t writes the BOS token's text into its rendering (Llama-3, Llama-2,
 * Gemma), so
 * the caller must tokenize the result with add_bos = false. Cannot fail. */
bool tdm_chat_template_writes_bos(tdm_chat_template_t t);

/* The template a model's prompts are rendered with and the default system message that goes
 * with it: what tdm_chat_template_pick chooses, what tdm_prompt_encode (tandem/prompt.h)
 * renders with. A plain value (about 4 KiB); nothing to free. */
typedef struct tdm_chat_pick {
    tdm_chat_template_t tmpl;
    char default_system[TDM_CHAT_DEFAULT_SYSTEM_MAX]; /* NUL-terminated; "" when none */
} tdm_chat_pick_t;

/* Picks the template for the prompts of the model g: *override when override is not NULL (the
 * config's model.chat_template, the CLI's --chat-template), else the family
 * tdm_chat_template_detect finds in g's tokenizer.chat_template. The model's default system
 * message is kept only when the picked template is the detected family, so an override naming
 * the model's own family keeps it and one naming another family drops it (the message was
 * written for the model's own template). The router, `tandem generate -m` and `tandem
 * tokenize --chat` all pick with this function, so they render the same prompt.
 * Returns 0 with *out set, or, when override is NULL, the errors of tdm_chat_template_detect
 * (TDM_EINVALID: no recognisable template, the message names the settings that choose one;
 * TDM_ERESOURCE). With an override it cannot fail: a model whose own template is missing,
 * unrecognised or has a default system message too long for the buffer just gives none.
 * On error *out is unspecified. Borrows g and override; keeps nothing. */
int tdm_chat_template_pick(const tdm_gguf_t *g, const tdm_chat_template_t *override,
                           tdm_chat_pick_t *out, tdm_error_t *err);

/* Renders n messages (msgs may be NULL when n is 0) with template t. add_generation_prompt
 * appends the header that opens the assistant's reply (ChatML "<|im_start|>assistant\n",
 * Llama-3 "<|start_header_id|>assistant<|end_header_id|>\n\n", Gemma
 * "<start_of_turn>model\n"; Llama-2 has none: its prompt already ends with " [/INST]").
 * default_system (NULL or "" for none) is used as the system message when msgs[0] is not one;
 * with n = 0 nothing but the generation prompt is written (Gemma: "<bos>" and the generation
 * prompt), as the Jinja templates do.
 * Roles must be "system", "user", "assistant" or "tool" (see tdm_chat_apply_tools for the
 * tool fields), a system message only at index 0; Llama-2 and Gemma
 * also require the other messages to alternate user, assistant, user, … (their templates
 * raise an exception otherwise; for Gemma a run of tool messages counts as a user turn).
 * On success *out is a NUL-terminated heap string of *out_len bytes (out_len may be NULL)
 * that the caller frees with free(). Errors: TDM_EINVALID for an unknown t, a NULL
 * msgs/role/content, an unknown role, a misplaced system message or broken alternation (the
 * message names the message index and its role); TDM_ERESOURCE on out of memory. On error
 * *out is NULL. */
int tdm_chat_apply(tdm_chat_template_t t, const tdm_chat_message_t *msgs, size_t n,
                   bool add_generation_prompt, const char *default_system, char **out,
                   size_t *out_len, tdm_error_t *err);

/* tdm_chat_apply with tool definitions: tools is NULL/"" (none, exactly tdm_chat_apply) or
 * OpenAI's tools, a JSON array text [{"type": "function", "function": {"name", "description",
 * "parameters"}}]. Messages may then also have role "tool" and assistant tool_calls (those
 * are accepted without tools as well). ChatML, Llama-3 and Gemma render them in the Hermes
 * format
 * (Qwen2.5's template, the one NousResearch's Hermes models were trained on):
 *  - the system message (msgs[0] when it is one, else default_system; "" when neither) is
 *    followed by "\n\n# Tools\n\nYou may call one or more functions to assist with the user
 *    query.\n\nYou are provided with function signatures within <tools></tools> XML
 *    tags:\n<tools>" + "\n" + each tool as JSON + "\n</tools>\n\nFor each function call,
 *    return a json object with function name and arguments within <tool_call></tool_call>
 *    XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\":
 *    <args-json-object>}\n</tool_call>" (without the leading "\n\n" when the system text
 *    is empty);
 *  - an assistant message with tool_calls is its content (when not empty) and, per call,
 *    "\n<tool_call>\n{\"name\": \"NAME\", \"arguments\": ARGS}\n</tool_call>" (ChatML
 *    writes "<|im_start|>assistant" then "\n" + content only when content is not empty, as
 *    Qwen2.5's template does);
 *  - a run of consecutive tool messages is one user turn holding, per message,
 *    "\n<tool_response>\n" + content + "\n</tool_response>".
 * JSON (each tool, ARGS) is written as Python's json.dumps(x, ensure_ascii=False) writes it
 * (", " and ": " separators, key order kept), which is what Jinja's tojson gives; ARGS is the
 * arguments JSON text re-written that way, or, when it does not parse, that text as a JSON
 * string. Numbers with a fraction are written by jansson (up to 17 significant digits), which
 * can differ from Python's shortest form. Llama-3 and Gemma trim each turn as usual; Gemma
 * writes the system text with the tools block at the start of the first user turn and the
 * tool results' user turn as "<start_of_turn>user\n<tool_response>…". Llama-2 has no
 * tool format: tools, tool_calls or a tool message there is TDM_EINVALID.
 * Errors: those of tdm_chat_apply, and TDM_EINVALID for tools that are not a JSON array of
 * objects, or tool_calls that are not a JSON array of objects with function.name a string
 * (the message names the message index). */
int tdm_chat_apply_tools(tdm_chat_template_t t, const tdm_chat_message_t *msgs, size_t n,
                         const char *tools, bool add_generation_prompt, const char *default_system,
                         char **out, size_t *out_len, tdm_error_t *err);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_CHAT_H */
