"""Write data.npz beside this file: 1,000 examples, 20 features, 3 classes.

Your own data goes in the same shape: ``x`` the features (one row per example), ``y``
the integer class labels 0..C-1 (one per example)."""

from pathlib import Path

import numpy as np
from sklearn.datasets import make_classification

x, y = make_classification(n_samples=1000, n_features=20, n_informative=10, n_classes=3, random_state=0)
out = Path(__file__).with_name("data.npz")
np.savez(out, x=x.astype(np.float32), y=y.astype(np.int64))
print(f"wrote {out}: x {x.shape}, y {y.shape}, classes {sorted(set(y.tolist()))}")
