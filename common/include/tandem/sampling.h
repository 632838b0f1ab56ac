/* sampling.h - per-request sampling parameters and the token sampler (logit bias, penalties,
 * greedy, top-k, temperature, top-p, min-p, counter-based random draw, logprobs).
 *
 * Pipeline, for one row of logits [n_vocab]:
 *   logit bias -> penalties -> (temperature 0: argmax) -> top-k -> temperature -> softmax
 *   -> top-p -> min-p -> draw.
 * Penalties are llama.cpp's (llama_sampler_penalties: repetition first, then frequency and
 * presence, over a window of the last penalty_last_n tokens of prompt + output); the
 * truncation order is Hugging Face transformers' generate() (temperature, top-k, top-p, min-p;
 * top-k does not depend on temperature, so it may run first).
 *
 * Counter-based randomness: the draw for output index i uses one uniform number that is a pure
 * function of (seed, i) (tdm_sampling_uniform), so a seeded request gives the same tokens
 * whether it ran in one process, was split between a prefill and a decode node, or was
 * migrated mid-stream. The sampler itself is deterministic: for the same build, the same
 * logits, history, parameters and index always give the same token, bit for bit (it uses its
 * own exp() so results do not depend on the libm version). See docs/sampling.md.
 */
#ifndef TANDEM_SAMPLING_H
#define TANDEM_SAMPLING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TDM_SAMPLING_MAX_STOP 16     /* most stop token ids per request */
#define TDM_SAMPLING_MAX_LOGPROBS 20 /* most top logprobs per token (OpenAI's limit) */
#define TDM_SAMPLING_MAX_TEMPERATURE 5.0f
#define TDM_SAMPLING_MAX_REPETITION_PENALTY 10.0f
#define TDM_SAMPLING_MAX_PENALTY 2.0f /* |presence_penalty|, |frequency_penalty| */
#define TDM_SAMPLING_DEFAULT_PENALTY_LAST_N 64
#define TDM_SAMPLING_DEFAULT_MAX_TOKENS 16 /* vLLM's and the OpenAI completions API's default */
#define TDM_SAMPLING_MAX_LOGIT_BIAS 300 /* most logit_bias entries per request (OpenAI's limit) */
#define TDM_SAMPLING_MAX_BIAS 100.0f    /* |bias| of a logit_bias entry (OpenAI's range) */
#define TDM_SAMPLING_MAX_BAD_WORDS 128  /* most bad_words strings per request */
#define TDM_SAMPLING_MAX_BAD_WORD_BYTES 256 /* bytes of one bad_words string */
/* token sequences of the bad words (each word as is and with a leading space: 2 per word) */
#define TDM_SAMPLING_MAX_BAD_SEQS 256
#define TDM_SAMPLING_MAX_BAD_TOKENS 1024 /* token ids of all bad-word sequences together */
#define TDM_SAMPLING_MAX_ALLOWED 1024    /* most allowed_token_ids entries per request */

/* One logit_bias entry: bias is added to token's logit before every other sampling step. */
typedef struct tdm_logit_bias {
    int32_t token; /* [0, n_vocab) */
    float bias;    /* [-100, 100]; -100 in effect bans the token, +100 in effect forces it */
} tdm_logit_bias_t;

/* A request's sampling parameters: a plain struct with no pointers, copied freely by value (it
 * travels with the request from router to prefill to decode node), so a copy is always valid
 * and owns nothing. The logit bias, the bad-word sequences and the allowed ids therefore live
 * in fixed-capacity arrays inside the struct (2.4 KB, 4.5 KB and 4 KB of its 11 KB); only
 * their first n_logit_bias / n_bad_seqs / n_allowed entries are used. Start from
 * tdm_sampling_params_default() or a preset, then set fields (logit bias through
 * tdm_sampling_logit_bias_add, bad words through tdm_sampling_bad_seq_add); check with
 * tdm_sampling_params_validate(). */
typedef struct tdm_sampling_params {
    float temperature;        /* [0, 5]; 0 = greedy (argmax, ties -> lowest token id) */
    int32_t top_k;            /* [0, n_vocab]; keep the k most likely tokens; 0 = off */
    float top_p;              /* (0, 1]; keep the smallest most-likely set with mass >= top_p;
                                 1 = off */
    float min_p;              /* [0, 1); drop tokens with p < min_p * p_max; 0 = off */
    float repetition_penalty; /* (0, 10]; logit > 0 -> logit / r, else logit * r, for tokens
                                 in the window (CTRL / llama.cpp); 1 = off */
    float presence_penalty;   /* [-2, 2]; logit -= presence * (count > 0) (OpenAI); 0 = off */
    float frequency_penalty;  /* [-2, 2]; logit -= frequency * count (OpenAI); 0 = off */
    int32_t penalty_last_n;   /* >= -1; penalty window: the last n tokens of prompt + output;
                                 -1 = all of them, 0 = penalties off; default 64 */
    uint64_t seed;            /* random stream of the request; 0 is an ordinary seed (the
                                 router draws one when the client gives none) */
    int32_t max_tokens;       /* >= 1; output tokens at most (checked by the caller) */
    int32_t stop_token_ids[TDM_SAMPLING_MAX_STOP]; /* [0, n_vocab); end generation */
    uint32_t n_stop_token_ids;                     /* [0, 16] entries used */
    bool ignore_eos;    /* keep going after end-of-generation tokens (the caller checks
                           tdm_tokenizer_is_eog unless this is set); stop_token_ids still stop */
    int32_t n_logprobs; /* [0, 20] top logprobs reported per token */

    /* The logit bias: entries [0, n_logit_bias) in strictly increasing token id, so one per id */
    uint32_t n_logit_bias; /* [0, 300] */
    tdm_logit_bias_t logit_bias[TDM_SAMPLING_MAX_LOGIT_BIAS];

    /* vLLM's min_tokens: while fewer than min_tokens output tokens exist, end-of-generation
     * tokens (unless ignore_eos) and stop_token_ids are masked and stop strings are not
     * matched. [0, max_tokens]; 0 = off */
    int32_t min_tokens;
    /* vLLM's bad_words as token sequences (the router tokenizes the words): sequence i is
     * bad_tokens[i ? bad_end[i - 1] : 0 .. bad_end[i]), 1..TDM_SAMPLING_MAX_BAD_TOKENS
     * tokens; its last token is masked whenever the output so far ends with the rest of it
     * (a one-token sequence: always). bad_end increases strictly. */
    uint32_t n_bad_seqs;                             /* [0, 256] */
    uint16_t bad_end[TDM_SAMPLING_MAX_BAD_SEQS];     /* end offsets into bad_tokens */
    int32_t bad_tokens[TDM_SAMPLING_MAX_BAD_TOKENS]; /* [0, n_vocab) */
    /* vLLM's allowed_token_ids: when n_allowed > 0 only these tokens can be sampled (in the
     * client's order; a repeated id is harmless). 0 = no restriction */
    uint32_t n_allowed;                        /* [0, 1024] */
    int32_t allowed[TDM_SAMPLING_MAX_ALLOWED]; /* [0, n_vocab) */
} tdm_sampling_params_t;

/* Fills *p with the defaults: temperature 1, top_k 0, top_p 1, min_p 0, repetition_penalty 1,
 * presence/frequency 0, penalty_last_n 64, seed 0, max_tokens 16, no stop ids, ignore_eos
 * false, n_logprobs 0, no logit bias (OpenAI's and vLLM's defaults). Cannot fail. */
void tdm_sampling_params_default(tdm_sampling_params_t *p);

/* Sets the fields of the named preset in *p and leaves every other field alone, so the
 * caller starts from defaults (or a request), applies a preset, then overrides fields:
 *   "precise"  temperature 0,    top_p 1.0
 *   "chat"     temperature 0.7,  top_p 0.9
 *   "creative" temperature 0.95, top_p 0.95
 * Returns 0, or TDM_EINVALID for an unknown (or NULL) name, with a message that lists the
 * presets; *p is untouched then. */
int tdm_sampling_preset(const char *name, tdm_sampling_params_t *p, tdm_error_t *err);

/* Checks every field against its range (see the struct). n_vocab bounds top_k, n_logprobs,
 * the stop token ids and the logit bias's token ids; pass 0 when the vocabulary is not known
 * yet (those bounds are then not checked). Returns 0, or TDM_EINVALID with err->field the
 * first bad field ("top_p", "stop_token_ids[2]", "logit_bias[\"7\"]") and a message beginning
 * with it, with its range and the value ("top_p must be in (0, 1], got 1.5"). NaN is
 * out of every range. O(fields + n_stop_token_ids + n_logit_bias). */
int tdm_sampling_params_validate(const tdm_sampling_params_t *p, uint32_t n_vocab,
                                 tdm_error_t *err);

/* The logit bias part of tdm_sampling_params_validate: n_logit_bias <= 300, token ids in
 * [0, n_vocab) (n_vocab 0: >= 0) and strictly increasing, biases in [-100, 100]. Returns 0, or
 * TDM_EINVALID with *bad (when not NULL) the index of the entry at fault (n_logit_bias itself
 * for too many entries; the later one of a repeated token id), err->field the entry by
 * OpenAI's key ("logit_bias[\"7\"]"; "logit_bias" for too many) and a message beginning with it,
 * with the limit and the value ("logit_bias[\"49152\"]: the token id must be in
 * [0, 49152), got 49152"; "logit_bias[\"7\"] must be in [-100, 100], got 101"). */
int tdm_sampling_logit_bias_check(const tdm_sampling_params_t *p, uint32_t n_vocab, uint32_t *bad,
                                  tdm_error_t *err);

/* Adds (token, bias) to p->logit_bias, keeping the entries in increasing token id (O(n) per
 * call). Returns 0, or TDM_EINVALID (err->field as tdm_sampling_logit_bias_check's): token < 0,
 * bias outside [-100, 100] (or NaN), token already there, or TDM_SAMPLING_MAX_LOGIT_BIAS entries
 * already; *p is untouched then. The
 * upper bound of the token id (n_vocab) is tdm_sampling_params_validate's. */
int tdm_sampling_logit_bias_add(tdm_sampling_params_t *p, int32_t token, float bias,
                                tdm_error_t *err);

/* Appends the token sequence ids[n] (n >= 1) to p's bad-word sequences. Returns 0, or
 * TDM_EINVALID with err->field "bad_words" when n is 0, TDM_SAMPLING_MAX_BAD_SEQS sequences
 * are there already, or the sequences would take more than TDM_SAMPLING_MAX_BAD_TOKENS token
 * ids ("bad_words: the words take more than 1024 tokens"); *p is untouched then. Token ids
 * are tdm_sampling_params_validate's to check. */
int tdm_sampling_bad_seq_add(tdm_sampling_params_t *p, const int32_t *ids, uint32_t n,
                             tdm_error_t *err);

/* The request masks of one sampling step into mask ((n_vocab + 31) / 32 words; bit t % 32 of
 * word t / 32 set = token t allowed), clearing bits only (the caller fills it first, all ones
 * or a grammar's mask): allowed_token_ids (every token not in the list), min_tokens (while
 * n_output < p->min_tokens: eog[n_eog] unless ignore_eos, and the stop_token_ids), and
 * bad_words (the last token of each sequence whose other tokens end output[n_output]; one
 * token: always). vLLM's order and semantics (its MinTokens, bad-words and allowed-token-ids
 * logits processors), as a mask so all of them apply after the logit bias and the penalties
 * and count as -inf (tdm_sampler_sample_masked). Ids outside [0, n_vocab) are skipped (the
 * caller validated them). Returns true when it cleared any bit (the caller then passes mask),
 * false when the request has none of these masks active at this step (mask untouched).
 * O(n_vocab / 32 + n_allowed + n_bad_tokens + n_eog); allocates nothing. */
bool tdm_sampling_request_mask(const tdm_sampling_params_t *p, uint32_t n_vocab, const int32_t *eog,
                               uint32_t n_eog, const int32_t *output, size_t n_output,
                               uint32_t *mask);

/* Whether the request has a mask tdm_sampling_request_mask may apply at some step (min_tokens,
 * bad words or allowed ids). Cannot fail. */
bool tdm_sampling_has_request_mask(const tdm_sampling_params_t *p);

/* True when token is one of p->stop_token_ids. EOS is the caller's business (tokenizer's
 * is_eog, unless p->ignore_eos). Cannot fail. */
bool tdm_sampling_is_stop(const tdm_sampling_params_t *p, int32_t token);

/* The uniform number in [0, 1) used to draw output index `index` of a request with `seed`:
 *   u = (mix(seed ^ mix(index)) >> 11) * 2^-53,
 * where mix(x) is SplitMix64's output function applied to x + 0x9e3779b97f4a7c15
 * (Steele, Lea, Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014).
 * A pure function: no state, cannot fail. */
double tdm_sampling_uniform(uint64_t seed, uint64_t index);

/* One (token, logprob) pair; logprob is a natural log. */
typedef struct tdm_token_logprob {
    int32_t token;
    float logprob;
} tdm_token_logprob_t;

/* What one call to tdm_sampler_sample produced. Logprobs are the log-softmax of the logits
 * after penalties and before temperature and truncation (see tdm_sampler_sample). */
typedef struct tdm_sample_result {
    int32_t token;  /* the sampled token id, [0, n_vocab) */
    float logprob;  /* its logprob */
    uint32_t n_top; /* = the request's n_logprobs: entries of top[] in use */
    tdm_token_logprob_t top[TDM_SAMPLING_MAX_LOGPROBS]; /* most likely first; ties by id */
} tdm_sample_result_t;

/* A sampler: scratch for one vocabulary, sized once. It samples for any request (parameters
 * come with each call) but is not thread-safe: use one per thread. */
typedef struct tdm_sampler tdm_sampler_t;

/* Creates a sampler for a vocabulary of n_vocab tokens (1 .. INT32_MAX), allocating all its
 * scratch now (about 24 bytes per token plus 96 KiB). Returns NULL with *err set: TDM_EINVALID for
 * a bad n_vocab, TDM_ERESOURCE on out of memory. Caller frees with tdm_sampler_destroy. */
tdm_sampler_t *tdm_sampler_new(uint32_t n_vocab, tdm_error_t *err);

/* Frees the sampler; accepts NULL and a NULL *self_p; sets *self_p to NULL. */
void tdm_sampler_destroy(tdm_sampler_t **self_p);

/* The message of the last failed tdm_sampler_sample ("" when none); owned by the sampler,
 * valid until its next call. */
const char *tdm_sampler_errmsg(const tdm_sampler_t *s);

/* True when the last tdm_sampler_sample_masked failed because its mask allowed no token: the
 * request's own constraints (grammar, allowed_token_ids, bad_words, min_tokens) leave nothing
 * to draw, the client's error rather than the engine's. False after a success or any other
 * failure. */
bool tdm_sampler_masked_out(const tdm_sampler_t *s);

/* Samples one token from logits [n_vocab] (float32, the model's raw output row; not
 * modified) for output index output_index (0 for the first generated token) of a request
 * with parameters p. history [n_history] is the request's tokens so far, prompt then output;
 * only its last penalty_last_n entries are read (none when penalties are off).
 *
 * Steps: the logit bias (logit += bias, as OpenAI and vLLM do, before everything else, so it
 * counts for greedy too); penalties; then temperature 0 -> the argmax (ties -> lowest id);
 * otherwise top-k, temperature, softmax, top-p, min-p (relative to the most likely token), and a
 * draw with u = tdm_sampling_uniform(p->seed, output_index) by inverse CDF over the kept tokens in
 * increasing token id. Ranking for top-k and top-p is by logit, ties by lower token id, so
 * the kept set is fully defined.
 * out->logprob and out->top[] come from the log-softmax of the biased and penalized logits
 * before temperature and truncation (between vLLM's raw and processed logprobs: bias and
 * penalties count, temperature/top-k/top-p/min-p do not), so greedy and sampled requests report the
 * same numbers and a truncated token still has a finite logprob.
 *
 * Allocates nothing. Cost: a few passes over n_vocab plus the penalty window.
 * Errors (message in tdm_sampler_errmsg; *out unspecified): TDM_EINVALID for parameters that
 * fail tdm_sampling_params_validate(p, n_vocab), a history token in the window outside
 * [0, n_vocab), a NaN or +inf logit, or logits that are all -inf. */
int tdm_sampler_sample(tdm_sampler_t *s, const tdm_sampling_params_t *p, const float *logits,
                       const int32_t *history, size_t n_history, uint64_t output_index,
                       tdm_sample_result_t *out);

/* tdm_sampler_sample under a token mask (structured output, tandem/grammar.h): bit (t % 32)
 * of mask[t / 32] set means token t is allowed; mask has (n_vocab + 31) / 32 words; NULL
 * allows every token (exactly tdm_sampler_sample). Masked tokens are excluded after the
 * logit bias and the penalties and before everything else (a +100 bias does not let a masked
 * token through): their logits count as -inf, so greedy takes the
 * most likely allowed token, top-k / top-p / min-p rank and weigh allowed tokens only, and the
 * draw is over allowed tokens. Logprobs are after masking: the log-softmax over the allowed
 * tokens (the distribution the token was drawn from at temperature 1), and out->n_top is
 * min(n_logprobs, allowed tokens), so no -inf is ever reported (docs/sampling.md). Allocates
 * nothing; one more pass over n_vocab. Errors as tdm_sampler_sample, and TDM_EINVALID when the
 * mask allows no token (tdm_sampler_masked_out then says so) or only tokens whose logits are
 * -inf. The request's own masks
 * (min_tokens, bad_words, allowed_token_ids) come in the same mask, ANDed in by the caller
 * (tdm_sampling_request_mask). */
int tdm_sampler_sample_masked(tdm_sampler_t *s, const tdm_sampling_params_t *p, const float *logits,
                              const uint32_t *mask, const int32_t *history, size_t n_history,
                              uint64_t output_index, tdm_sample_result_t *out);

/* The logprob of one given token under a row of logits, with its rank and the n_top most
 * likely tokens: a prompt token's logprob given its prefix (vLLM's prompt_logprobs). */
typedef struct tdm_token_logprobs {
    int32_t token;  /* the token asked about */
    float logprob;  /* its logprob: the log-softmax of the raw logits */
    uint32_t rank;  /* 1 + the tokens more likely than it; ties count as more likely (vLLM) */
    uint32_t n_top; /* entries of top[] in use */
    tdm_token_logprob_t top[TDM_SAMPLING_MAX_LOGPROBS]; /* most likely first; ties by id */
} tdm_token_logprobs_t;

/* The log-softmax of logits [n_vocab] (the model's raw row: no bias, penalties, mask or
 * temperature, as vLLM's prompt logprobs) at token, its rank, and the n_top most likely tokens
 * (n_top <= TDM_SAMPLING_MAX_LOGPROBS), into *out. Computed exactly as tdm_sampler_sample
 * computes its logprobs, so for a request without bias and penalties the numbers are bitwise
 * those it reports for the same row. Allocates nothing. Errors (message in
 * tdm_sampler_errmsg): TDM_EINVALID for a token outside [0, n_vocab), n_top over the limit, a
 * NaN or +inf logit, or logits that are all -inf. */
int tdm_sampler_token_logprobs(tdm_sampler_t *s, const float *logits, int32_t token, uint32_t n_top,
                               tdm_token_logprobs_t *out);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_SAMPLING_H */
