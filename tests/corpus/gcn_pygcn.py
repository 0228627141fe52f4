"""A two-layer graph convolutional network trained as Kipf & Welling's pygcn trains it
(github.com/tkipf/pygcn, pygcn/layers.py, models.py, utils.py, train.py): the adjacency
renormalised with self-loops (D^-1/2 (A + I) D^-1/2 is pygcn's later form; pygcn's row
normalisation D^-1 (A + I) is used here, as in its utils.py), built as a scipy COO matrix and
converted with ``sparse_mx_to_torch_sparse_tensor``, moved to the GPU with ``.cuda()``; each layer is
``support = torch.mm(input, weight)``, ``output = torch.spmm(adj, support) + bias``; Adam, a few
epochs, NLL loss on the training nodes.

A synthetic Cora-sized graph (2708 nodes, 1433 features, 7 classes, 5429 undirected edges) with a
fixed seed: nothing is downloaded. Prints one line per epoch and the final figures.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from torch import nn

NODES, FEATURES, CLASSES, EDGES, HIDDEN, EPOCHS = 2708, 1433, 7, 5429, 16, 5


def normalize(mx: sp.spmatrix) -> sp.spmatrix:
    """Row-normalize a sparse matrix (pygcn utils.normalize)."""
    rowsum = np.array(mx.sum(1))
    r_inv = np.power(rowsum, -1).flatten()
    r_inv[np.isinf(r_inv)] = 0.0
    return sp.diags(r_inv).dot(mx)


def sparse_mx_to_torch_sparse_tensor(sparse_mx: sp.spmatrix) -> torch.Tensor:
    """Convert a scipy sparse matrix to a torch sparse tensor (pygcn utils)."""
    sparse_mx = sparse_mx.tocoo().astype(np.float32)
    indices = torch.from_numpy(np.vstack((sparse_mx.row, sparse_mx.col)).astype(np.int64))
    values = torch.from_numpy(sparse_mx.data)
    return torch.sparse_coo_tensor(indices, values, torch.Size(sparse_mx.shape))


class GraphConvolution(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        stdv = 1.0 / self.weight.size(1) ** 0.5
        self.weight.data.uniform_(-stdv, stdv)
        self.bias.data.uniform_(-stdv, stdv)

    def forward(self, input: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        support = torch.mm(input, self.weight)
        output = torch.spmm(adj, support)
        return output + self.bias


class GCN(nn.Module):
    def __init__(self, nfeat: int, nhid: int, nclass: int, dropout: float) -> None:
        super().__init__()
        self.gc1 = GraphConvolution(nfeat, nhid)
        self.gc2 = GraphConvolution(nhid, nclass)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.gc1(x, adj))
        x = F.dropout(x, self.dropout, training=self.training)
        x = self.gc2(x, adj)
        return F.log_softmax(x, dim=1)


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(0)
    features = sp.csr_matrix((rng.random((NODES, FEATURES)) < 0.0127).astype(np.float32))
    labels = rng.integers(0, CLASSES, NODES)
    edges = rng.integers(0, NODES, (EDGES, 2))
    adj = sp.coo_matrix((np.ones(EDGES), (edges[:, 0], edges[:, 1])), shape=(NODES, NODES), dtype=np.float32)
    adj = adj + adj.T.multiply(adj.T > adj) - adj.multiply(adj.T > adj)  # symmetric (pygcn)
    features = normalize(features)
    adj = normalize(adj + sp.eye(adj.shape[0]))
    return (sparse_mx_to_torch_sparse_tensor(adj), torch.FloatTensor(np.array(features.todense())),
            torch.LongTensor(labels))


def main() -> None:
    torch.manual_seed(42)
    adj, features, labels = load_data()
    idx_train = torch.LongTensor(range(140))
    model = GCN(FEATURES, HIDDEN, CLASSES, dropout=0.5)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    model.cuda()
    features, adj, labels, idx_train = features.cuda(), adj.cuda(), labels.cuda(), idx_train.cuda()
    for epoch in range(EPOCHS):
        model.train()
        optimizer.zero_grad()
        output = model(features, adj)
        loss_train = F.nll_loss(output[idx_train], labels[idx_train])
        loss_train.backward()
        optimizer.step()
        print(f"epoch {epoch + 1}: nnz {adj._nnz()}")
    print(f"allocated {torch.cuda.memory_allocated()} peak {torch.cuda.max_memory_allocated()} "
          f"reserved {torch.cuda.memory_reserved()}")


if __name__ == "__main__":
    main()
