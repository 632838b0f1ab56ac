/* test_prompt.c - tdm_chat_template_pick and tdm_prompt_encode on the tiny model (ChatML
 * template, BOS <|im_start|> = id 510, EOS <|im_end|> = id 511): which template and default
 * system message are picked, the BOS and special-token rules, and the errors. That the router,
 * `tandem generate -m` and `tandem tokenize --chat` agree is test_router.c's
 * test_prompt_agrees. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/chat.h"
#include "tandem/gguf.h"
#include "tandem/prompt.h"
#include "tandem/tokenizer.h"
#include "tdm_test.h"
#include "tiny_model.h"

#define BOS 510

/* The tiny model with tokenizer.chat_template = tpl (NULL: the tiny model's own, ChatML
 * without a default system message) and add_bos_token = add_bos. Caller destroys *g, *tok. */
static void open_model(const char *tpl, bool add_bos, tdm_gguf_t **g, tdm_tokenizer_t **tok,
                       void **data)
{
    tdm_tiny_llama_spec_t spec = {.n_vocab = 512, .n_layers = 1};
    tdm_gguf_writer_t *w = NULL;
    tdm_error_t err = {0};
    size_t size = 0;
    assert_int_equal(tdm_test_tiny_llama_build(&spec, &w, &err), 0);
    if (tpl)
        assert_int_equal(tdm_gguf_writer_set_str(w, "tokenizer.chat_template", tpl), 0);
    assert_int_equal(tdm_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", add_bos), 0);
    assert_int_equal(tdm_gguf_writer_to_memory(w, data, &size), 0);
    tdm_gguf_writer_destroy(&w);
    *g = tdm_gguf_open_memory(*data, size, &err);
    assert_non_null(*g);
    *tok = tdm_tokenizer_new(*g, &err);
    assert_non_null(*tok);
}

static void close_model(tdm_gguf_t **g, tdm_tokenizer_t **tok, void *data)
{
    tdm_tokenizer_destroy(tok);
    tdm_gguf_destroy(g);
    free(data);
}

/* No override: the model's tokenizer.chat_template compiled as Jinja; a built-in name picks
 * that family, keeping the default system message only for the model's own family; a model
 * template that does not compile is an error (field tokenizer.chat_template, line:column) that
 * an override gets past; an override file must exist. */
static void test_pick(void **state)
{
    (void)state;
    static const char tpl[] = "{{ '<|im_start|>system\\nBe kind.<|im_end|>\\n' }}"
                              "{% for m in messages %}<|im_start|>{% endfor %}";
    tdm_gguf_t *g;
    tdm_tokenizer_t *tok;
    void *data;
    open_model(tpl, false, &g, &tok, &data);
    tdm_chat_pick_t pick;
    tdm_error_t err = {0};
    assert_int_equal(tdm_chat_template_pick(g, tok, NULL, &pick, &err), 0);
    assert_non_null(pick.jinja);
    assert_string_equal(pick.origin, "gguf");
    assert_string_equal(pick.bos_token, "<|im_start|>");
    assert_string_equal(pick.eos_token, "<|im_end|>");
    tdm_chat_pick_release(&pick);
    assert_null(pick.jinja);
    assert_int_equal(tdm_chat_template_pick(g, tok, "chatml", &pick, &err), 0);
    assert_null(pick.jinja);
    assert_int_equal(pick.tmpl, TDM_CHAT_TEMPLATE_CHATML);
    assert_string_equal(pick.default_system, "Be kind.");
    assert_int_equal(tdm_chat_template_pick(g, tok, "llama3", &pick, &err), 0);
    assert_int_equal(pick.tmpl, TDM_CHAT_TEMPLATE_LLAMA3);
    assert_string_equal(pick.default_system, "");
    assert_string_equal(pick.origin, "llama3");
    close_model(&g, &tok, data);

    open_model("Hi\n{% if %}", false, &g, &tok, &data);
    assert_int_equal(tdm_chat_template_pick(g, tok, NULL, &pick, &err), TDM_EINVALID);
    assert_null(pick.jinja);
    assert_string_equal(err.field, "tokenizer.chat_template");
    assert_non_null(strstr(err.msg, "does not compile"));
    assert_non_null(strstr(err.msg, ": 2:"));
    assert_int_equal(tdm_chat_template_pick(g, tok, "llama2", &pick, &err), 0);
    assert_int_equal(pick.tmpl, TDM_CHAT_TEMPLATE_LLAMA2);
    assert_string_equal(pick.default_system, "");
    assert_int_equal(tdm_chat_template_pick(g, tok, "/nonexistent/t.jinja", &pick, &err),
                     TDM_ENOTFOUND);
    assert_non_null(strstr(err.msg, "/nonexistent/t.jinja"));
    assert_non_null(strstr(err.msg, "262144 bytes"));
    assert_int_equal(tdm_chat_template_check("/nonexistent/t.jinja", &err), TDM_ENOTFOUND);
    assert_int_equal(tdm_chat_template_check("gemma", &err), 0);
    close_model(&g, &tok, data);
}

/* Raw text: special tokens matched, BOS as the tokenizer says. Chat: BOS only where the
 * template does not write it; an explicit system message replaces the default one. */
static void test_encode(void **state)
{
    (void)state;
    tdm_gguf_t *g;
    tdm_tokenizer_t *tok;
    void *data;
    tdm_error_t err = {0};
    tdm_token_t *ids = NULL;
    size_t n = 0;
    char *text = NULL;
    for (int add_bos = 0; add_bos < 2; add_bos++) {
        open_model(NULL, add_bos, &g, &tok, &data);
        tdm_prompt_input_t raw = {.text = "<|im_end|>", .text_len = 10};
        assert_int_equal(tdm_prompt_encode(tok, NULL, &raw, &ids, &n, &text, &err), 0);
        assert_null(text);
        assert_int_equal(n, (size_t)(1 + add_bos));
        assert_int_equal(ids[n - 1], 511);
        if (add_bos)
            assert_int_equal(ids[0], BOS);
        free(ids);

        tdm_chat_pick_t pick = {.tmpl = TDM_CHAT_TEMPLATE_CHATML};
        tdm_chat_message_t user = {.role = "user", .content = "x"};
        tdm_prompt_input_t chat = {.messages = &user, .n_messages = 1, .system = "S"};
        assert_int_equal(tdm_prompt_encode(tok, &pick, &chat, &ids, &n, &text, &err), 0);
        assert_string_equal(text, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nx"
                                  "<|im_end|>\n<|im_start|>assistant\n");
        assert_int_equal(ids[0], BOS);
        assert_int_equal(ids[1], add_bos ? BOS : tdm_test_tiny_byte_token('s'));
        free(ids);
        free(text);

        pick.tmpl = TDM_CHAT_TEMPLATE_LLAMA2;
        snprintf(pick.default_system, sizeof pick.default_system, "D");
        chat.system = NULL;
        assert_int_equal(tdm_prompt_encode(tok, &pick, &chat, &ids, &n, &text, &err), 0);
        assert_string_equal(text, "<s>[INST] <<SYS>>\nD\n<</SYS>>\n\nx [/INST]");
        assert_int_equal(ids[0], tdm_test_tiny_byte_token('<')); /* no BOS added */
        free(ids);
        free(text);
        close_model(&g, &tok, data);
    }
}

static void test_errors(void **state)
{
    (void)state;
    tdm_gguf_t *g;
    tdm_tokenizer_t *tok;
    void *data;
    open_model(NULL, true, &g, &tok, &data);
    tdm_error_t err = {0};
    tdm_token_t *ids = (tdm_token_t *)&err;
    size_t n = 7;
    char *text = (char *)&err;
    tdm_chat_message_t bad = {.role = "robot", .content = "x"};
    tdm_prompt_input_t chat = {.messages = &bad, .n_messages = 1};
    assert_int_equal(tdm_prompt_encode(tok, NULL, &chat, &ids, &n, &text, &err), TDM_EINVALID);
    assert_null(ids);
    assert_int_equal(n, 0);
    assert_null(text);
    tdm_chat_pick_t pick = {.tmpl = TDM_CHAT_TEMPLATE_CHATML};
    chat.system = "S"; /* counted as message 0: the bad role is message 1 */
    assert_int_equal(tdm_prompt_encode(tok, &pick, &chat, &ids, &n, &text, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "robot"));
    assert_null(ids);
    assert_null(text);
    close_model(&g, &tok, data);
}

/* continue_final_message: the rendering ends right after the last message's content, without
 * the generation prompt, for the built-in templates and a Jinja one (transformers' cut: the
 * stripped content's last occurrence, its trailing whitespace kept where the rendering kept
 * it); a template that changes the content is an error; an empty content keeps it all. */
static void test_continue_final_message(void **state)
{
    (void)state;
    tdm_gguf_t *g;
    tdm_tokenizer_t *tok;
    void *data;
    tdm_error_t err = {0};
    tdm_token_t *ids = NULL;
    size_t n = 0;
    char *text = NULL;
    open_model(NULL, false, &g, &tok, &data);
    tdm_chat_message_t msgs[2] = {{.role = "user", .content = "Hel"},
                                  {.role = "assistant", .content = "Hel lo"}};
    tdm_prompt_input_t in = {.messages = msgs, .n_messages = 2, .continue_final_message = true};
    static const tdm_chat_template_t builtins[] = {
        TDM_CHAT_TEMPLATE_CHATML, TDM_CHAT_TEMPLATE_LLAMA3, TDM_CHAT_TEMPLATE_LLAMA2};
    for (size_t i = 0; i < sizeof builtins / sizeof builtins[0]; i++) {
        tdm_chat_pick_t pick = {.tmpl = builtins[i]};
        assert_int_equal(tdm_prompt_encode(tok, &pick, &in, &ids, &n, &text, &err), 0);
        size_t len = strlen(text);
        assert_true(len > 6);
        assert_string_equal(text + len - 6, "Hel lo");
        free(ids);
        free(text);
    }
    /* trailing whitespace: kept where the rendering keeps it (ChatML writes the content as is) */
    tdm_chat_pick_t chatml = {.tmpl = TDM_CHAT_TEMPLATE_CHATML};
    msgs[1].content = "Hel lo  ";
    assert_int_equal(tdm_prompt_encode(tok, &chatml, &in, &ids, &n, &text, &err), 0);
    assert_string_equal(text, "<|im_start|>user\nHel<|im_end|>\n<|im_start|>assistant\nHel lo  ");
    free(ids);
    free(text);
    /* a Jinja template that trims the content: cut after the stripped content */
    static const char trim_tpl[] =
        "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}|"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}";
    tdm_jinja_t *j = tdm_chat_jinja_compile(trim_tpl, sizeof trim_tpl - 1, &err);
    assert_non_null(j);
    in.jinja = j;
    assert_int_equal(tdm_prompt_encode(tok, NULL, &in, &ids, &n, &text, &err), 0);
    assert_string_equal(text, "[user] Hel|[assistant] Hel lo");
    free(ids);
    free(text);
    msgs[1].content = "";
    assert_int_equal(tdm_prompt_encode(tok, NULL, &in, &ids, &n, &text, &err), 0);
    assert_string_equal(text, "[user] Hel|[assistant] |");
    free(ids);
    free(text);
    tdm_jinja_destroy(&j);
    static const char upper_tpl[] = "{% for m in messages %}{{ m.content | upper }}{% endfor %}";
    j = tdm_chat_jinja_compile(upper_tpl, sizeof upper_tpl - 1, &err);
    assert_non_null(j);
    in.jinja = j;
    msgs[1].content = "Hel lo";
    assert_int_equal(tdm_prompt_encode(tok, NULL, &in, &ids, &n, &text, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "continue_final_message"));
    assert_null(ids);
    tdm_jinja_destroy(&j);
    close_model(&g, &tok, data);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pick),
        cmocka_unit_test(test_encode),
        cmocka_unit_test(test_continue_final_message),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
