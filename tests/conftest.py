"""pytest's harness: before any test imports triton, choose Triton's interpreter when there is no GPU (chapter 95)."""
from nanoserve.testing import use_triton_interpreter

use_triton_interpreter()
