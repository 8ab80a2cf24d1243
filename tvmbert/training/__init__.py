"""TVM inside PyTorch training: Relax autodiff and ``add_tvm_dispatch``. May import everything
below it: core to tuning."""
