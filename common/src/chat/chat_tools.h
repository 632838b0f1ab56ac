/* chat_tools.h - the Hermes tool-calling pieces of the chat templates (chat_tools.c), private to
 * common/src/chat. The format itself is documented at tdm_chat_apply_tools (tandem/chat.h). */
#ifndef TANDEM_CHAT_TOOLS_H
#define TANDEM_CHAT_TOOLS_H

#include "tandem/base.h"

/* Appends the tools part of the system message for tools (a JSON array text of OpenAI tool
 * definitions) to sb: "# Tools\n\nYou may call ... <tools>\n{tool}\n...\n</tools>\n\nFor each
 * function call, ... </tool_call>". Returns 0, TDM_EINVALID when tools is not a JSON array of
 * objects (message names "tools" and the index), TDM_ERESOURCE on out of memory. */
int chat_tools_block(const char *tools, tdm_buf_t *sb, tdm_error_t *err);

/* Appends the rendering of an assistant message's tool_calls (a JSON array text) to sb: per
 * call "\n<tool_call>\n{\"name\": \"NAME\", \"arguments\": ARGS}\n</tool_call>". index is the
 * message's, for the error. Returns 0, TDM_EINVALID (not an array of objects with
 * function.name a string; the message names the message and the call), TDM_ERESOURCE. */
int chat_tool_calls_text(const char *tool_calls, size_t index, tdm_buf_t *sb, tdm_error_t *err);

#endif /* TANDEM_CHAT_TOOLS_H */
