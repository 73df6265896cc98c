# The boinc-dl server: one VM running the docker compose stack, a data volume, an
# Elastic IP, HTTP(S)-only ingress, and the stack's secrets in Secrets Manager.

locals {
  tags     = merge({ "boinc-dl:role" = "server" }, var.tags)
  kms_key  = var.kms_key_arn != null ? var.kms_key_arn : aws_kms_key.this[0].arn
  url_base = "http://${aws_eip.this.public_ip}"
}

data "aws_caller_identity" "current" {}

data "aws_subnet" "this" {
  id = var.subnet_id
}

data "aws_iam_policy_document" "kms" {
  #checkov:skip=CKV_AWS_109: a key policy's resource "*" means this key; root keeps admin so the key stays manageable
  #checkov:skip=CKV_AWS_111: same: the key policy applies only to this key
  #checkov:skip=CKV_AWS_356: same: "*" in a key policy is the key itself
  statement {
    sid       = "AccountAdmin"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:aws:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }
}

resource "aws_kms_key" "this" {
  count                   = var.kms_key_arn == null ? 1 : 0
  description             = "${var.name}: server volumes and secrets"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.kms.json
  tags                    = local.tags
}

# --- secrets ---------------------------------------------------------------------------
# The Redis password is drawn by Secrets Manager at creation (it is in the state: keep the state in an
# encrypted backend). The weak account key has no value here: the admin stores it after
# creating the project's account, so it never enters the state or any user-data.

data "aws_secretsmanager_random_password" "redis" {
  password_length     = 40
  exclude_punctuation = true
}

resource "aws_secretsmanager_secret" "redis_password" {
  #checkov:skip=CKV2_AWS_57: Redis reads requirepass at start; rotating it means restarting the stack, done by the admin
  name_prefix = "${var.name}-redis-password-"
  description = "boinc-dl: Redis requirepass of the server stack"
  kms_key_id  = local.kms_key
  tags        = local.tags
}

resource "aws_secretsmanager_secret_version" "redis_password" {
  secret_id     = aws_secretsmanager_secret.redis_password.id
  secret_string = data.aws_secretsmanager_random_password.redis.random_password
  # The data source draws a new password on every read: keep the first one.
  lifecycle {
    ignore_changes = [secret_string]
  }
}

resource "aws_secretsmanager_secret" "weak_key" {
  #checkov:skip=CKV2_AWS_57: a BOINC weak account key changes only with the account's password; no rotation Lambda applies
  name_prefix = "${var.name}-weak-account-key-"
  description = "boinc-dl: the project's weak account key the fleet's hosts attach with (value set by the admin)"
  kms_key_id  = local.kms_key
  tags        = local.tags
}

# --- network ---------------------------------------------------------------------------

resource "aws_security_group" "this" {
  name_prefix = "${var.name}-server-"
  description = "boinc-dl server: HTTP(S) in, SSH only from admin CIDRs"
  vpc_id      = var.vpc_id
  tags        = local.tags
}

resource "aws_vpc_security_group_ingress_rule" "http" {
  #checkov:skip=CKV_AWS_260: BOINC clients reach the scheduler and file servers over HTTP from anywhere; narrow http_cidrs to the fleet's ranges if no volunteer joins
  for_each          = toset(var.http_cidrs)
  security_group_id = aws_security_group.this.id
  description       = "HTTP: BOINC scheduler, uploads, downloads, web pages"
  ip_protocol       = "tcp"
  from_port         = 80
  to_port           = 80
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_ingress_rule" "https" {
  for_each          = toset(var.http_cidrs)
  security_group_id = aws_security_group.this.id
  description       = "HTTPS: the same behind TLS"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_ingress_rule" "ssh" {
  for_each          = toset(var.admin_ssh_cidrs)
  security_group_id = aws_security_group.this.id
  description       = "SSH from an admin network"
  ip_protocol       = "tcp"
  from_port         = 22
  to_port           = 22
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_egress_rule" "all" {
  security_group_id = aws_security_group.this.id
  description       = "Packages, image builds, Secrets Manager"
  ip_protocol       = "-1"
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_eip" "this" {
  domain = "vpc"
  tags   = merge(local.tags, { Name = "${var.name}-server" })
}

resource "aws_eip_association" "this" {
  allocation_id = aws_eip.this.id
  instance_id   = aws_instance.this.id
}

# --- identity: read its own secret, nothing else ----------------------------------------

data "aws_iam_policy_document" "assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "server" {
  statement {
    sid       = "ReadRedisPassword"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [aws_secretsmanager_secret.redis_password.arn]
  }
  statement {
    sid       = "DecryptIt"
    actions   = ["kms:Decrypt"]
    resources = [local.kms_key]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["secretsmanager.${var.region}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "this" {
  name_prefix        = "${var.name}-server-"
  assume_role_policy = data.aws_iam_policy_document.assume.json
  tags               = local.tags
}

resource "aws_iam_role_policy" "this" {
  name   = "read-own-secret"
  role   = aws_iam_role.this.id
  policy = data.aws_iam_policy_document.server.json
}

resource "aws_iam_role_policy_attachment" "ssm" {
  role       = aws_iam_role.this.name
  policy_arn = "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

resource "aws_iam_instance_profile" "this" {
  name_prefix = "${var.name}-server-"
  role        = aws_iam_role.this.name
}

# --- the VM and its data disk -------------------------------------------------------------

resource "aws_instance" "this" {
  #checkov:skip=CKV_AWS_126: detailed (1-minute) monitoring is a paid extra; the stack's own logs and the admin page cover it
  #checkov:skip=CKV2_AWS_41: false positive: the instance has an IAM instance profile (iam_instance_profile below)
  ami                         = var.ami_id
  instance_type               = var.instance_type
  subnet_id                   = var.subnet_id
  vpc_security_group_ids      = [aws_security_group.this.id]
  iam_instance_profile        = aws_iam_instance_profile.this.name
  ebs_optimized               = true
  user_data_replace_on_change = false
  user_data = templatefile("${path.module}/../../cloud-init/server.yaml.tftpl", {
    cloud           = "aws"
    region          = var.region
    redis_secret_id = aws_secretsmanager_secret.redis_password.arn
    source_repo     = var.source_repo
    source_ref      = var.source_ref
    url_base        = local.url_base
    # Nitro instances expose EBS volumes as NVMe; udev links them by volume id.
    data_device = "/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_${replace(aws_ebs_volume.data.id, "-", "")} /dev/xvdf"
  })

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1 # only the host's own boot script asks IMDS
  }

  root_block_device {
    encrypted   = true
    kms_key_id  = local.kms_key
    volume_size = var.root_volume_gb
    volume_type = "gp3"
  }

  tags = merge(local.tags, { Name = "${var.name}-server" })

  depends_on = [aws_secretsmanager_secret_version.redis_password]
}

resource "aws_ebs_volume" "data" {
  availability_zone = data.aws_subnet.this.availability_zone
  size              = var.data_volume_gb
  type              = "gp3"
  encrypted         = true
  kms_key_id        = local.kms_key
  tags              = merge(local.tags, { Name = "${var.name}-server-data" })
}

resource "aws_volume_attachment" "data" {
  device_name = "/dev/xvdf"
  volume_id   = aws_ebs_volume.data.id
  instance_id = aws_instance.this.id
}
