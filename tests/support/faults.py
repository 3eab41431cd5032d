"""Faults planted in the code path under test, to prove the checks that should catch them do."""

from hsextract.model.capture import LayerCapture


class ShiftedCapture(LayerCapture):
    """The classic bug, planted: hooks one layer deeper than asked (the output of layer k + 1 for id k)."""

    def __enter__(self):
        self.deepest += 1
        for j, k in enumerate(self.layer_ids):
            self._handles.append(self.layers[k + 1].register_forward_hook(self._make_hook(j, k + 1)))
        return self
