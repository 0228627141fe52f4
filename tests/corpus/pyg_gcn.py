"""A two-layer GCN in PyTorch Geometric (``torch_geometric.nn.GCNConv``) trained on a synthetic
Cora-sized graph (2708 nodes, 1433 features, 7 classes, 10556 directed edges), as PyG's
examples/gcn.py trains it: Adam, NLL loss. ``--sparse`` first applies ``T.ToSparseTensor()``, so
the adjacency is a ``torch.sparse_csr`` tensor (``adj_t``) and each layer's propagation is a sparse
matrix product (``torch.sparse.mm``), as without torch_sparse installed. Prints one line per epoch
with the memory allocated, and the peak. Nothing is downloaded.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import torch_geometric.transforms as T
from torch_geometric.data import Data
from torch_geometric.nn import GCNConv

NODES, FEATURES, CLASSES, EDGES, HIDDEN, EPOCHS = 2708, 1433, 7, 10556, 16, 3


class GCN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = GCNConv(FEATURES, HIDDEN)
        self.conv2 = GCNConv(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x, edges))
        x = F.dropout(x, 0.5, self.training)
        return F.log_softmax(self.conv2(x, edges), dim=1)


def main() -> None:
    torch.manual_seed(0)
    sparse = "--sparse" in sys.argv
    data = Data(x=torch.randn(NODES, FEATURES), edge_index=torch.randint(0, NODES, (2, EDGES)),
                y=torch.randint(0, CLASSES, (NODES,)))
    if sparse:
        data = T.ToSparseTensor()(data)
    model, data = GCN().to("cuda"), data.to("cuda")
    edges = data.adj_t if sparse else data.edge_index
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    for epoch in range(EPOCHS):
        model.train()
        optimizer.zero_grad()
        loss = F.nll_loss(model(data.x, edges), data.y)
        loss.backward()
        optimizer.step()
        print(f"epoch {epoch + 1}: {edges.layout} {edges.device} allocated {torch.cuda.memory_allocated()}")
    print(f"peak {torch.cuda.max_memory_allocated()}")


if __name__ == "__main__":
    main()
