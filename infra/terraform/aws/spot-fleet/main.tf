# A spot fleet of BOINC hosts: launch template + auto scaling group with a mixed
# instances policy, and the interruption queue the fleet controller reads.

locals {
  tags        = merge({ "boinc-dl:role" = "host", "boinc-dl:fleet" = var.name }, var.tags)
  requirement = coalesce(var.boinc_dl_requirement, "boinc-dl[${var.variant}]")
}

data "aws_caller_identity" "current" {}

# --- hosts' identity: read the weak key, nothing else ----------------------------------

data "aws_iam_policy_document" "assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "host" {
  statement {
    sid       = "ReadWeakKey"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [var.weak_key_secret_arn]
  }
  statement {
    sid       = "DecryptIt"
    actions   = ["kms:Decrypt"]
    resources = [var.kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["secretsmanager.${var.region}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "host" {
  name_prefix        = "${var.name}-host-"
  assume_role_policy = data.aws_iam_policy_document.assume.json
  tags               = local.tags
}

resource "aws_iam_role_policy" "host" {
  name   = "read-weak-key"
  role   = aws_iam_role.host.id
  policy = data.aws_iam_policy_document.host.json
}

resource "aws_iam_instance_profile" "host" {
  name_prefix = "${var.name}-host-"
  role        = aws_iam_role.host.name
}

resource "aws_security_group" "host" {
  name_prefix = "${var.name}-host-"
  description = "boinc-dl hosts: no inbound; outbound to the project, packages, AWS APIs"
  vpc_id      = var.vpc_id
  tags        = local.tags
}

resource "aws_vpc_security_group_egress_rule" "host" {
  security_group_id = aws_security_group.host.id
  description       = "The BOINC project, package indexes, Secrets Manager"
  ip_protocol       = "-1"
  cidr_ipv4         = "0.0.0.0/0"
}

# --- launch template and group ------------------------------------------------------------

resource "aws_launch_template" "this" {
  name_prefix   = "${var.name}-"
  description   = "boinc-dl ${var.variant} host"
  image_id      = var.ami_id
  ebs_optimized = true
  user_data = base64encode(templatefile("${path.module}/../../cloud-init/host.yaml.tftpl", {
    cloud       = "aws"
    region      = var.region
    project_url = var.project_url
    secret_id   = var.weak_key_secret_arn
    requirement = local.requirement
  }))

  iam_instance_profile {
    arn = aws_iam_instance_profile.host.arn
  }

  vpc_security_group_ids = [aws_security_group.host.id]

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1 # the watcher and the app run on the host, not in a container
    instance_metadata_tags      = "disabled"
  }

  # DNS name = instance id: the controller's second way to find the BOINC host.
  private_dns_name_options {
    hostname_type = "resource-name"
  }

  block_device_mappings {
    device_name = "/dev/sda1"
    ebs {
      encrypted             = true
      kms_key_id            = var.kms_key_arn
      volume_size           = var.root_volume_gb
      volume_type           = "gp3"
      delete_on_termination = true
    }
  }

  tag_specifications {
    resource_type = "instance"
    tags          = local.tags
  }

  tag_specifications {
    resource_type = "volume"
    tags          = local.tags
  }

  tags = local.tags
}

resource "aws_autoscaling_group" "this" {
  name                      = var.name
  min_size                  = var.min_size
  max_size                  = var.max_size
  desired_capacity          = var.min_size
  vpc_zone_identifier       = var.subnet_ids
  capacity_rebalance        = true
  health_check_type         = "EC2"
  wait_for_capacity_timeout = "0"

  mixed_instances_policy {
    instances_distribution {
      on_demand_base_capacity                  = var.on_demand_base_capacity
      on_demand_percentage_above_base_capacity = var.on_demand_percentage
      on_demand_allocation_strategy            = "lowest-price"
      spot_allocation_strategy                 = "price-capacity-optimized"
    }
    launch_template {
      launch_template_specification {
        launch_template_id = aws_launch_template.this.id
        version            = aws_launch_template.this.latest_version
      }
      dynamic "override" {
        for_each = var.instance_types
        content {
          instance_type = override.value
        }
      }
    }
  }

  # The fleet controller owns the size (desired capacity) and the on-demand share.
  lifecycle {
    ignore_changes = [
      desired_capacity,
      mixed_instances_policy[0].instances_distribution[0].on_demand_percentage_above_base_capacity,
    ]
  }

  dynamic "tag" {
    for_each = local.tags
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }
}

# --- interruption events -> SQS -------------------------------------------------------

resource "aws_sqs_queue" "interruptions" {
  name                      = "${var.name}-interruptions"
  sqs_managed_sse_enabled   = true
  message_retention_seconds = 3600 # a warning older than an hour is about a VM long gone
  receive_wait_time_seconds = 20
  tags                      = local.tags
}

resource "aws_cloudwatch_event_rule" "interruptions" {
  name        = "${var.name}-interruptions"
  description = "Spot interruption warnings and rebalance recommendations for ${var.name}"
  event_pattern = jsonencode({
    source      = ["aws.ec2"]
    detail-type = ["EC2 Spot Instance Interruption Warning", "EC2 Instance Rebalance Recommendation"]
  })
  tags = local.tags
}

resource "aws_cloudwatch_event_target" "interruptions" {
  rule      = aws_cloudwatch_event_rule.interruptions.name
  target_id = "sqs"
  arn       = aws_sqs_queue.interruptions.arn
}

data "aws_iam_policy_document" "queue" {
  statement {
    sid       = "EventBridgeOnly"
    actions   = ["sqs:SendMessage"]
    resources = [aws_sqs_queue.interruptions.arn]
    principals {
      type        = "Service"
      identifiers = ["events.amazonaws.com"]
    }
    condition {
      test     = "ArnEquals"
      variable = "aws:SourceArn"
      values   = [aws_cloudwatch_event_rule.interruptions.arn]
    }
  }
}

resource "aws_sqs_queue_policy" "interruptions" {
  queue_url = aws_sqs_queue.interruptions.id
  policy    = data.aws_iam_policy_document.queue.json
}

# --- the fleet controller's permissions (attach to its role or user) ----------------------

data "aws_iam_policy_document" "controller" {
  statement {
    sid = "ResizeThisGroup"
    actions = [
      "autoscaling:SetDesiredCapacity",
      "autoscaling:UpdateAutoScalingGroup",
      "autoscaling:TerminateInstanceInAutoScalingGroup",
    ]
    resources = [aws_autoscaling_group.this.arn]
  }
  statement {
    # Describe* calls take no resource-level permissions: "*" is the only valid resource.
    sid = "DescribeOnly"
    actions = [
      "autoscaling:DescribeAutoScalingGroups",
      "autoscaling:DescribeScalingActivities",
      "ec2:DescribeInstances",
      "ec2:DescribeSpotPriceHistory",
    ]
    resources = ["*"]
  }
  statement {
    sid       = "ReadInterruptions"
    actions   = ["sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:GetQueueAttributes"]
    resources = [aws_sqs_queue.interruptions.arn]
  }
  statement {
    # UpdateAutoScalingGroup re-validates the launch template.
    sid       = "UseLaunchTemplate"
    actions   = ["ec2:RunInstances", "ec2:CreateTags"]
    resources = ["*"]
    condition {
      test     = "StringEquals"
      variable = "aws:RequestedRegion"
      values   = [var.region]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:ResourceAccount"
      values   = [data.aws_caller_identity.current.account_id]
    }
  }
  statement {
    sid       = "PassHostRole"
    actions   = ["iam:PassRole"]
    resources = [aws_iam_role.host.arn]
  }
}

resource "aws_iam_policy" "controller" {
  name_prefix = "${var.name}-controller-"
  description = "boinc-dl fleet controller for ${var.name}: resize the group, read its interruption queue and prices"
  policy      = data.aws_iam_policy_document.controller.json
  tags        = local.tags
}
