/* commands.h - the `tandem` tool's subcommands; each lives in cmd_<name>.c.
 * Each takes the arguments after the subcommand name (argv[0] is the subcommand) and returns
 * the process exit status: 0 success, 1 failure of the operation, 2 bad usage. */
#ifndef TANDEM_CLIENT_COMMANDS_H
#define TANDEM_CLIENT_COMMANDS_H

int tdm_cmd_inspect(int argc, char **argv);
int tdm_cmd_tokenize(int argc, char **argv);
int tdm_cmd_config(int argc, char **argv);
int tdm_cmd_kvcalc(int argc, char **argv);
int tdm_cmd_generate(int argc, char **argv);
int tdm_cmd_version(int argc, char **argv);
int tdm_cmd_chat(int argc, char **argv);
int tdm_cmd_status(int argc, char **argv);
int tdm_cmd_bench(int argc, char **argv);
int tdm_cmd_cluster(int argc, char **argv);
int tdm_cmd_keys(int argc, char **argv);
int tdm_cmd_grammar(int argc, char **argv);
int tdm_cmd_tokenizer(int argc, char **argv);
int tdm_cmd_model(int argc, char **argv);
int tdm_cmd_embed(int argc, char **argv);

#endif
