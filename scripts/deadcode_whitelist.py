"""Names scripts/deadcode.py must count as used: what uses each is outside Python's view (a protocol another
library calls, a string, a public field read by users' code). Vulture reads this file; it is never imported.
Each line names one attribute; the comment says who uses it."""
# ruff: noqa: B018, F821

# File and unpickler protocols (torch.save, DCP, pickle and io call these)
_.readable
_.writable
_.find_class
_.persistent_load
_.synchronize_staging  # DCP's AsyncStager
_.extra_repr  # torch.nn.Module's repr
_.__signature__  # inspect.signature reads it (LLM.__init__ shows LLMConfig's options)
_._last_lr  # torch.optim.lr_scheduler.LRScheduler.get_last_lr reads it
_.benchmark  # torch.backends.cudnn.benchmark, set
_.dump_ptxas_log  # triton's knobs, set
_.pre_tokenizer  # tokenizers.Tokenizer settings, set
_.post_processor
_.unk_id  # a public field of the tokenizer wrapper
_.describe_size  # smalti.core.data calls it by name (SIZE_METHOD)
_.position_is_global  # smalti.core.data reads it by name (GLOBAL_POSITION)
_.commit_semantics  # ObjectStore's documented contract, for users and the README
_.GcsStore  # smalti.storage.registry names it in a string

# Hydra: the config search path plugin is found by its package (hydra_plugins), its method called by Hydra
_.SmaltiSearchPathPlugin
_.manipulate_search_path

# Jinja2's sandbox: class attributes and a call signature it defines
_.intercepted_binops
__self

# http.server and socketserver call these on the fault proxy's handler and server
_.protocol_version
_.log_message
_.handle_error
_.daemon_threads
_.do_GET
_.do_PUT
_.do_POST
_.do_HEAD
_.do_DELETE
_.do_PATCH
client_address

# import-linter: the contract type named in pyproject.toml and the methods it calls
_.AcyclicModulesContract
_.type_name
_.render_broken_contract

# Public fields of the trainer's state, time and plugin records, for callbacks, loggers and users
_.eval_label
_.train_metrics
_.token_in_epoch
_.total_wct
_.entry_point
_.proportion  # smalti.streaming.Stream, set from configs
_.choose
_.full_order  # smalti.streaming.epoch_orders.EpochOrders: StreamingDataset._compute_order reads it by name

# Public names of the event table, for plugins choosing which events to handle
_.MICROBATCH_EVENTS
_.EVAL_EVENTS

# Found unused by the scan, in files other changes are rewriting now (core dispatch, smalti-streaming,
# smalti-llm): left to those changes (issue 40)
_.implemented
_.rank_batches
_.has_bias  # smalti.llm.model.norms: set on the autograd ctx, never read
