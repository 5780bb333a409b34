"""arctic-platform as verl's remote backend: an out-of-tree plugin.

    pip install "arctic-platform[verl]"
    export VERL_USE_EXTERNAL_MODULES=arctic_platform.integrations.verl.register
    python -m verl.trainer.main_ppo ... remote_backend=arctic actor_rollout_ref.rollout.name=arctic

Modules: :mod:`.register` (the entry hook verl imports), :mod:`.adapter` (the ``RemoteBackend``),
:mod:`.worker` (the CPU forwarder), :mod:`.rollout` (the rollout replica), :mod:`.grpo_loss` (verl's
loss), :mod:`.verl_config` (verl config -> client config), :mod:`.batch_convert` (verl batches <->
wire layout), :mod:`.selection` and :mod:`.compat`. Importing this package imports none of them, so
the loss module works without verl installed.
"""
