"""The lab: the merge explorer, figures, the notebook kernel and papermill reports."""
