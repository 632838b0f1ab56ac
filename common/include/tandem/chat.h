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

#include <jansson.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/gguf.h"
#include "tandem/jinja.h"
#include "tandem/tokenizer.h"

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
    const char *content;           /* may be NULL only for an assistant message with tool_calls */
    const char *tool_calls;        /* assistant: NULL/"" or OpenAI's tool_calls, a JSON array text
                                      [{"id", "type": "function", "function": {"name", "arguments"}}]
                                      (arguments a JSON text in a string, or an object) */
    const char *tool_call_id;      /* tool: NULL/"" or the id of the call this result answers */
    const char *name;              /* tool: NULL/"" or the function's name (not rendered) */
    const char *reasoning_content; /* assistant: NULL/"" or its reasoning (a Jinja template's
                                      message.reasoning_content) */
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

/* The largest chat template accepted, in bytes: a template file (model.chat_template,
 * --chat-template) and a request's chat_template. The largest of llama.cpp's 70 templates has
 * about 20 KiB. */
#define TDM_CHAT_TEMPLATE_MAX_BYTES (256 * 1024)

/* A bos_token / eos_token text buffer size, in bytes with the NUL. */
#define TDM_CHAT_TOKEN_TEXT_MAX 128

/* The template a model's prompts are rendered with: what tdm_chat_template_pick chooses, what
 * tdm_prompt_encode (tandem/prompt.h) renders with. Either a compiled Jinja template (jinja
 * not NULL: the model's tokenizer.chat_template or a template file) or a built-in family
 * (tmpl, with the default system message that goes with it). Owns jinja: release with
 * tdm_chat_pick_release; do not copy a pick that holds one. */
typedef struct tdm_chat_pick {
    tdm_chat_template_t tmpl;                         /* the built-in, when jinja is NULL */
    char default_system[TDM_CHAT_DEFAULT_SYSTEM_MAX]; /* built-in only; "" when none */
    tdm_jinja_t *jinja;                               /* owned; NULL: the built-in tmpl */
    char bos_token[TDM_CHAT_TOKEN_TEXT_MAX]; /* the BOS token's text ("<s>"); "" when none */
    char eos_token[TDM_CHAT_TOKEN_TEXT_MAX]; /* the EOS token's text; "" when none */
    char origin[32]; /* "gguf" (the model's tokenizer.chat_template), "file", or the built-in
                        name ("chatml"): what /v1/models and the logs show */
} tdm_chat_pick_t;

/* Picks the template for the prompts of the model g (tok: its tokenizer, for the BOS and EOS
 * texts the templates read as bos_token and eos_token; NULL: both ""). override (NULL: none) is
 * the config's model.chat_template or the CLI's --chat-template: a built-in name
 * (TDM_CHAT_TEMPLATE_NAMES) or the path of a Jinja template file. The choice:
 *  - a file: read (at most TDM_CHAT_TEMPLATE_MAX_BYTES) and compiled as transformers compiles
 *    (trim_blocks, lstrip_blocks);
 *  - a built-in name: that family; the model's default system message is kept only when the
 *    model's own template is of that family (tdm_chat_template_detect);
 *  - no override: the model's tokenizer.chat_template compiled as Jinja; a model without one
 *    gets the built-in family tdm_chat_template_detect finds (Gemma for gemma* files).
 * The router, `tandem generate -m` and `tandem tokenize --chat` all pick with this function,
 * so they render the same prompt. On success *out holds the pick (release it with
 * tdm_chat_pick_release). Errors (*out released): TDM_EINVALID with field
 * "tokenizer.chat_template" when the model's template does not compile (the message has its
 * line:column and names the override settings), with field "chat_template" when the override's
 * file does not compile (path:line:column), and without a field when the model has no
 * template Tandem can use (the detect error); TDM_ENOTFOUND / TDM_EUNAVAILABLE /
 * TDM_ERESOURCE for an override file that is missing / unreadable / larger than the limit
 * (the message names the path and the limit); TDM_ERESOURCE on out of memory.
 * Borrows g, tok and override; keeps nothing of them. */
int tdm_chat_template_pick(const tdm_gguf_t *g, const tdm_tokenizer_t *tok, const char *override,
                           tdm_chat_pick_t *out, tdm_error_t *err);

/* Frees the Jinja template a pick holds and sets pick->jinja to NULL; accepts NULL. */
void tdm_chat_pick_release(tdm_chat_pick_t *pick);

/* Checks a model.chat_template / --chat-template value without a model: a built-in name, or a
 * file that exists, is readable and holds at most TDM_CHAT_TEMPLATE_MAX_BYTES (compiling it
 * needs no model, and is done too). Returns 0, or the errors of tdm_chat_template_pick's
 * override file (the message names the path and the limit). `tandem config check` runs it. */
int tdm_chat_template_check(const char *override, tdm_error_t *err);

/* Compiles len bytes of Jinja chat template source as transformers' apply_chat_template does
 * (trim_blocks and lstrip_blocks on). Returns the template (caller frees with
 * tdm_jinja_destroy) or NULL: TDM_EINVALID ("line:column: what"; more than
 * TDM_CHAT_TEMPLATE_MAX_BYTES also), TDM_ERESOURCE (out of memory). */
tdm_jinja_t *tdm_chat_jinja_compile(const char *src, size_t len, tdm_error_t *err);

/* What a Jinja chat template is rendered with (tdm_chat_apply_jinja). Pointers are borrowed. */
typedef struct tdm_chat_jinja_input {
    const tdm_chat_message_t *msgs; /* n messages (NULL when 0) */
    size_t n;
    const char *tools;          /* NULL/"" or OpenAI's tools, a JSON array text */
    bool add_generation_prompt; /* the template's add_generation_prompt variable */
    const char *bos_token;      /* the template's bos_token (NULL: "") */
    const char *eos_token;      /* the template's eos_token (NULL: "") */
    const json_t *kwargs;       /* NULL or a JSON object of more variables (a request's
                                   chat_template_kwargs); its members override bos_token,
                                   eos_token and add_generation_prompt */
    int64_t now;                /* strftime_now's time, seconds since the epoch; < 0: the clock */
} tdm_chat_jinja_input_t;

/* Renders a Jinja chat template with the variables transformers' apply_chat_template passes:
 * messages (each message's role, content (null when NULL), and when set tool_calls (the JSON
 * array, each call's function.arguments parsed from its JSON text into an object as
 * transformers expects; kept a string when it does not parse), tool_call_id, name and
 * reasoning_content), tools
 * (the parsed array, or null), documents (null), add_generation_prompt, bos_token, eos_token,
 * then the members of kwargs. Render limits are tandem/jinja.h's defaults.
 * On success *out is a NUL-terminated heap string of *out_len bytes (out_len may be NULL) that
 * the caller frees with free(). Errors (*out NULL): TDM_EINVALID for tools or tool_calls that
 * are not JSON arrays, kwargs that is not an object or sets messages or tools, and for every
 * template failure: jinja2's message with the template's line:column, raise_exception's
 * message exactly (then *raised is true when raised is not NULL), and a render limit passed
 * (output bytes, steps, depth, memory: the message names the limit and the line:column);
 * TDM_ERESOURCE when building the variables runs out of memory. */
int tdm_chat_apply_jinja(const tdm_jinja_t *tmpl, const tdm_chat_jinja_input_t *in, char **out,
                         size_t *out_len, bool *raised, tdm_error_t *err);

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

/* Messages rewritten by tdm_chat_tools_inline: msgs[n] point into texts (owned) and into the
 * caller's messages (borrowed). Release with tdm_chat_inline_release. */
typedef struct tdm_chat_inline {
    tdm_chat_message_t *msgs;
    size_t n;
    char **texts;
    size_t n_texts;
} tdm_chat_inline_t;

/* For a Jinja chat template that does not read `tools` (tdm_jinja_reads; SmolLM2's GGUF
 * template, for one): msgs rewritten so that the model still sees the tools, in the Hermes
 * format tdm_chat_apply_tools writes (as llama.cpp falls back to a generic tool format for
 * such templates): the system message (msgs[0] when it is one, else a new one with the block
 * alone; a template's own default system message is then not used) followed by "\n\n" and
 * the tools block; an assistant message's tool_calls appended to its content as <tool_call>
 * blocks (its tool_calls then dropped); each run of tool messages one user message of
 * "<tool_response>\n" + content + "\n</tool_response>" blocks joined by "\n". With ChatML the
 * rendering is then byte for byte the built-in one's, the system message aside. The other
 * messages are copied as they are. Errors (*out zeroed): those of tdm_chat_apply_tools for
 * tools and tool_calls, TDM_ERESOURCE. */
int tdm_chat_tools_inline(const tdm_chat_message_t *msgs, size_t n, const char *tools,
                          tdm_chat_inline_t *out, tdm_error_t *err);

/* Frees what tdm_chat_tools_inline made and zeroes *in; accepts NULL. */
void tdm_chat_inline_release(tdm_chat_inline_t *in);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_CHAT_H */
