"""Convert a local Hugging Face folder to an Orbax checkpoint (see maxtext.checkpoint.convert).

python scripts/convert_hf_checkpoint.py --hf_model_path DIR --output_dir OUT [--weight_dtype bfloat16]
"""

import sys

from maxtext.checkpoint.convert import main

if __name__ == "__main__":
  sys.exit(main())
